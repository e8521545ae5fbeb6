"""`hf:ORG/NAME` models from the local Hugging Face cache (never downloaded, offline), and
`surgeon reference --dtype/--device`.

The cache is a real hub layout built in tmp (``models--ORG--NAME/{refs/main, blobs/<sha256>,
snapshots/<commit>/<file> -> ../../blobs/<sha256>}``) from a tiny random model saved by
transformers; the CLI runs in a subprocess with ``HF_HOME`` pointed at it and ``HF_HUB_OFFLINE=1``,
as a user's shell would set them (huggingface_hub reads them when it is imported)."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from surgeon.cli import main
from surgeon.core.errors import BadInput
from surgeon.core.points import layer_out
from surgeon.run.tinymodels import make_tiny_model
from surgeon.verify.reference import capture_reference, load_reference, resolve_model

REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
IDS = [5, 9, 2, 7, 11]


def build_cache(hf_home: Path, repo: str, model_dir: Path) -> Path:
    """Put ``model_dir``'s files into a Hugging Face hub cache under ``hf_home`` as huggingface_hub
    lays it out; returns the snapshot folder."""
    org, name = repo.split("/")
    repo_dir = hf_home / "hub" / f"models--{org}--{name}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)
    snap = repo_dir / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for f in sorted(model_dir.iterdir()):
        blob = repo_dir / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    model = make_tiny_model("llama", d / "model", num_layers=3, hidden_size=32, seed=4)
    snap = build_cache(d / "home", REPO, model)
    return d, model, snap


def surgeon(args, hf_home, cwd):
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "surgeon", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def test_hf_org_name_is_run_from_the_local_cache_offline(cache, tmp_path):
    d, model, snap = cache
    out = tmp_path / "ref.safetensors"
    p = surgeon(["reference", f"hf:{REPO}", "--input-ids", ",".join(map(str, IDS)), "-o", out], d / "home", tmp_path)
    assert p.returncode == 0, p.stderr
    got = load_reference(out)
    assert got.source == f"hf:{REPO}@{COMMIT}"
    want = capture_reference(model, IDS)  # the same weights, read from the folder they were saved to
    assert got.num_layers == 3 and all(torch.equal(got.states[k], want.states[k]) for k in want.states)
    # and as a --reference of match: the subject's slots are identified against the cached model
    subject = tmp_path / "s.safetensors"
    save_file({"x": want.states[layer_out(1)], "input_ids": torch.tensor(IDS)}, str(subject))
    p = surgeon(["match", subject, "--reference", f"hf:{REPO}", "--json"], d / "home", tmp_path)
    assert p.returncode == 0, p.stderr
    assert '"matched": "layer_out[1]"' in p.stdout


def test_a_model_not_in_the_cache_says_how_to_fetch_it(cache, tmp_path):
    d, _, _ = cache
    p = surgeon(["reference", "hf:tiny-org/absent", "--input-ids", "1,2", "-o", tmp_path / "r.safetensors"], d / "home",
                tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "tiny-org/absent: no such directory, and not in the local Hugging Face cache" in p.stderr
    assert "hf download tiny-org/absent" in p.stderr and str(d / "home" / "hub") in p.stderr
    assert not (tmp_path / "r.safetensors").exists()


def test_a_local_folder_wins_over_the_cache(cache, tmp_path, monkeypatch):
    d, model, _ = cache
    local = tmp_path / "tiny-org" / "tiny-llama"
    shutil.copytree(model, local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model(REPO) == (Path(REPO), f"hf:{local.resolve()}")
    for bad in (tmp_path / "nope", "a/b/c", "config.json"):
        with pytest.raises(BadInput, match="not a model directory"):
            resolve_model(bad)


def test_reference_dtype_and_device(cache, tmp_path):
    _, model, _ = cache
    f32, bf16 = tmp_path / "f32.safetensors", tmp_path / "bf16.safetensors"
    for dtype, out in (("float32", f32), ("bfloat16", bf16)):
        res = CliRunner().invoke(main, ["reference", str(model), "--input-ids", "5,9,2", "-o", str(out), "--dtype", dtype])
        assert res.exit_code == 0, res.output
    a, b = load_reference(f32), load_reference(bf16)
    x, y = a.states[layer_out(2)], b.states[layer_out(2)]
    assert y.dtype == torch.float32 and not torch.equal(x, y)  # run in bf16, stored as float32
    assert float((x - y).norm() / x.norm()) < 0.05
    assert all(torch.equal(v, v.to(torch.bfloat16).float()) for v in b.states.values())  # bf16 values, exactly
    for device in ("nope", "meta"):
        res = CliRunner().invoke(main, ["reference", str(model), "--input-ids", "5", "-o", str(tmp_path / "x"),
                                        "--device", device])
        assert res.exit_code == 2 and f"--device {device}: not usable here" in res.stderr, res.output
    assert not (tmp_path / "x").exists()


@pytest.mark.gpu
def test_reference_on_cuda_matches_the_cpu(cache, tmp_path):
    _, model, _ = cache
    cpu = capture_reference(model, IDS)
    gpu = capture_reference(model, IDS, device="cuda")
    for k, v in cpu.states.items():
        assert gpu.states[k].device.type == "cpu"
        assert torch.allclose(gpu.states[k], v, rtol=1e-3, atol=1e-4), k
