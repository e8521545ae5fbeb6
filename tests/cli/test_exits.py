"""Exit codes at the edges of a real process: a reader that closes the pipe early (exit 0, quiet),
and an optional extra that is not installed (exit 2 naming it and how to install it, never
"internal error: ModuleNotFoundError"). Both run the real CLI in a subprocess."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from surgeon.audit.structure import STATE_NAME
from surgeon.capture.dumps import write_dump
from surgeon.core.points import EMBED, layer_out

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "specs" / "kimi-k2.5-eagle3.yaml"


def into_closed_pipe(*args):
    """Run surgeon with stdout a pipe whose reader is already gone: every write meets EPIPE."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "surgeon", *map(str, args)], stdout=w, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    finally:
        os.close(w)
    return p


@pytest.mark.parametrize("args", [
    ("explain", KIMI),            # rich text
    ("explain", KIMI, "--json"),  # JSON
    ("schema",),
    ("render", KIMI, "--engine", "vllm"),
])
def test_a_closed_pipe_exits_0_quietly(args):
    p = into_closed_pipe(*args)
    assert (p.returncode, p.stderr) == (0, "")


def test_head_closing_the_pipe_midway_exits_0():
    p = subprocess.run(f"{sys.executable} -m surgeon explain {KIMI} | head -1; echo \"${{PIPESTATUS[0]}}\"",
                       shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    first, code = p.stdout.splitlines()
    assert first.startswith("kimi-k2.5-eagle3") and code == "0" and p.stderr == ""


def without(module, *args, cwd=None):
    """The CLI in a process where ``module`` cannot be imported (as if its extra were not installed)."""
    code = f"import sys; sys.modules[{module!r}] = None; sys.argv[0] = 'surgeon'; from surgeon.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("extras")
    t = torch.randn(3, 8)
    write_dump(d / "dump.safetensors", [("a", EMBED, t), ("b", layer_out(0), t.clone())], input_ids=torch.arange(3), num_layers=2)
    spec = d / "s.yaml"
    spec.write_text(textwrap.dedent("""\
        spec: 1
        name: tiny
        target: {architecture: LlamaForCausalLM, num_layers: 2, hidden_size: 8}
        captures: {a: embed, b: 'layer_out[0]'}
        draft: {kind: eagle3, fc_input: [b]}
        """))
    (d / "model").mkdir()
    return d


@pytest.mark.parametrize("module, args", [
    ("torch", ("match", "{d}/dump.safetensors", "--reference", "{d}/dump.safetensors")),
    ("torch", ("verify", "{d}/s.yaml", "--subject", "{d}/dump.safetensors", "--reference", "{d}/dump.safetensors")),
    ("torch", ("fingerprint", "{d}/dump.safetensors", "-o", "{d}/fp.safetensors")),
    ("torch", ("reference", "{d}/model", "--input-ids", "1,2", "-o", "{d}/ref.safetensors")),
    ("torch", ("export", "{d}/dump.safetensors", "--spec", "{d}/s.yaml", "--layout", "speculators", "-o", "{d}/out")),
    ("transformers", ("reference", "{d}/model", "--input-ids", "1,2", "-o", "{d}/ref.safetensors")),
    ("transformers", ("match", "{d}/dump.safetensors", "--reference", "hf:{d}/model")),
    ("matplotlib", ("match", "{d}/dump.safetensors", "--reference", "{d}/dump.safetensors", "--plot", "{d}/h.png")),
    ("numba", ("audit", "{d}", "--spec", "{d}/s.yaml", "--workers", "1")),
])
def test_a_missing_extra_is_exit_2_naming_it(files, module, args):
    p = without(module, *(a.format(d=files) for a in args))
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr and "internal error" not in p.stderr
    assert p.stderr.startswith(f"surgeon: {module} is not installed; ")
    assert "pip install 'hidden-state-surgeon[harness]'" in p.stderr
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in p.stderr
    assert not any((files / n).exists() for n in ("fp.safetensors", "ref.safetensors", "out", "h.png", STATE_NAME))


def test_what_needs_no_torch_runs_without_it(files):
    p = without("torch", "dump-info", files / "dump.safetensors", "--json")
    assert p.returncode == 0 and '"layer_out[0]"' in p.stdout, p.stderr
    p = without("torch", "hooks", KIMI, "--mode", "aux", "--max-tokens", "8")
    assert p.returncode == 0 and "SPEC_NAME = 'kimi-k2.5-eagle3'" in p.stdout, p.stderr
    p = without("torch", "explain", KIMI)
    assert p.returncode == 0, p.stderr


def test_a_module_missing_inside_an_installed_extra_is_still_an_internal_error():
    from surgeon.core.optional import missing_dependency

    assert missing_dependency(ModuleNotFoundError("no torch", name="torch")).extra == "harness"
    assert missing_dependency(ModuleNotFoundError("x", name="torch._C")) is None  # a broken install: a bug to see
    assert missing_dependency(ModuleNotFoundError("x", name="yaml")) is None
    assert missing_dependency(ImportError("x", name="torch")) is None
