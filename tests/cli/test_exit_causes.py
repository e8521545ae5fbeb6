"""Exit codes by cause (issue 36, items 1 and 6): bad input and environment faults are exit 2 with
one line, never "internal error"; ``-o`` of reference and fingerprint never overwrites; export
never deletes or replaces a file a forged manifest names; Ctrl-C at any instant of start-up is one
line and exit 130. Real files, links, FIFOs, a real tiny HF model (``field_target``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from surgeon.cli import main
from tests.conftest import default_sigint

REPO = Path(__file__).resolve().parents[2]


def invoke(*args, code: int = 2):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == code, (args, res.output)
    return res


def one_line(res, *needles: str) -> None:
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in res.output and "internal error" not in err, res.output
    for n in needles:
        assert n in err, err


# -- -o never overwrites --------------------------------------------------------------------------------------
def test_reference_and_fingerprint_refuse_an_existing_output_and_never_write_through_a_link(tmp_path, field_target):
    _, ref_file, _ = field_target
    model = ref_file.parent / "model"
    mine = tmp_path / "mine.txt"
    mine.write_bytes(b"keep me")
    link = tmp_path / "link.safetensors"
    link.symlink_to(mine)
    for out in (mine, link):
        one_line(invoke("reference", f"hf:{model}", "--input-ids", "1,2,3", "-o", out), str(out))
        one_line(invoke("fingerprint", ref_file, "-o", out), str(out))
    assert mine.read_bytes() == b"keep me" and link.is_symlink()
    invoke("fingerprint", ref_file, "-o", tmp_path / "new.fp", code=0)  # a new file is written
    assert (tmp_path / "new.fp").stat().st_size > 0


# -- a model folder transformers cannot load is bad input ------------------------------------------------------
def test_a_model_folder_with_damaged_weights_is_bad_input_not_an_internal_error(tmp_path, field_target):
    _, ref_file, _ = field_target
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes((ref_file.parent / "model" / "config.json").read_bytes())
    (model / "model.safetensors").write_bytes(b"\xff" * 64)  # "header too large": SafetensorError, was exit 1
    one_line(invoke("reference", f"hf:{model}", "--input-ids", "1,2,3", "-o", tmp_path / "r.safetensors"), str(model))
    (model / "config.json").write_text("{not json")
    one_line(invoke("reference", f"hf:{model}", "--input-ids", "1,2,3", "-o", tmp_path / "r.safetensors"),
             "config.json", "invalid JSON")
    assert not (tmp_path / "r.safetensors").exists()


# -- export deletes or replaces only what it wrote --------------------------------------------------------------
@pytest.fixture
def exported(tmp_path, field_target):
    from tests.conftest import write_trtllm

    ref, _, spec = field_target
    src = tmp_path / "trt"
    src.mkdir()
    for i in range(2):
        write_trtllm(src / f"data_{i}.pt", ref, {1, 3, 5})
    out = tmp_path / "out"
    args = ["export", src, "--spec", spec, "--layout", "specforge", "-o", out, "--slots", "trtllm:1,3,5"]
    invoke(*args, code=0)
    return out, args


def _forge(out: Path, entries: list[dict]) -> None:
    (out / "surgeon-export.json").write_text(json.dumps({"surgeon.kind": "export", "files": entries}))


def test_a_forged_manifest_makes_export_delete_or_replace_nothing(tmp_path, exported):
    out, args = exported
    listed = json.loads((out / "surgeon-export.json").read_text())["files"]
    assert all(len(f["sha256"]) == 64 for f in listed)
    invoke(*args, code=0)  # its own earlier export: replaced, as before
    notes = out / "notes.txt"
    notes.write_text("mine")
    for forged in ([{"file": "notes.txt"}], [{"file": "notes.txt", "sha256": "0" * 64}]):
        _forge(out, listed + forged)
        one_line(invoke(*args), "notes.txt", "no surgeon export wrote")
        assert notes.read_text() == "mine"
    notes.unlink()
    (out / "data_1.ckpt").write_bytes(b"the user's own file under an exported name")
    _forge(out, listed)  # the manifest's digest no longer matches: not export's file any more
    one_line(invoke(*args), "data_1.ckpt")
    assert (out / "data_1.ckpt").read_bytes() == b"the user's own file under an exported name"


def test_an_exported_name_swapped_for_a_link_or_a_linked_manifest_is_refused(tmp_path, exported):
    out, args = exported
    outside = tmp_path / "outside.txt"
    outside.write_text("outside")
    (out / "data_1.ckpt").unlink()
    (out / "data_1.ckpt").symlink_to(outside)
    one_line(invoke(*args), "data_1.ckpt")
    assert outside.read_text() == "outside" and (out / "data_1.ckpt").is_symlink()
    (out / "data_1.ckpt").unlink()
    manifest = out / "surgeon-export.json"
    (tmp_path / "m.json").write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(tmp_path / "m.json")
    one_line(invoke(*args), "surgeon-export.json", "symbolic link")


# -- Ctrl-C during start-up ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_ctrl_c_at_any_instant_of_start_up_is_one_line_and_exit_130():
    """SIGINT at spread instants of `surgeon explain` (imports, parsing, the command, shutdown):
    one line and 130, or the command finished first (0). Killed by the signal itself (-2, no
    output) only when it lands before Python installs its handler: nothing Python can catch."""
    spec = REPO / "specs" / "demo-tiny-llama-eagle3.yaml"
    seen = []
    for delay in (0.15, 0.4, 0.7, 1.0, 1.4, 1.9, 2.5):
        p = subprocess.Popen([sys.executable, "-m", "surgeon", "explain", str(spec), "--json"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)), preexec_fn=default_sigint)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        seen.append(p.returncode)
        assert "Traceback" not in err and "Aborted" not in err, err
        if p.returncode == 130:
            assert err == "surgeon: interrupted\n", err
        else:
            assert p.returncode in (0, -signal.SIGINT), (p.returncode, err)
    assert 130 in seen

