"""`surgeon demo` as a newcomer runs it: the real vLLM engine, a tiny model, a verified dump, a
mis-wiring caught with its heatmap, and the engine left byte-identical."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from surgeon.patching import patch_status

pytestmark = pytest.mark.engine


def test_demo_runs_end_to_end_and_leaves_the_engine_as_it_was(tmp_path: Path):
    assert not patch_status(engine="vllm")
    work = tmp_path / "demo"
    p = subprocess.run([sys.executable, "-m", "surgeon", "demo", "--workdir", str(work), "--json"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["ok"] and r["reverted_byte_identical"]
    assert [s["verdict"] for s in r["right"]["slots"]] == ["ok"] * 4
    wrong = {s["name"]: (s["declared"], s["matched"], s["verdict"]) for s in r["wrong"]["slots"]}
    assert wrong == {"low": ("embed", "layer_out[1]", "mismatch"), "mid": ("layer_out[1]", "layer_out[3]", "mismatch"),
                     "high": ("layer_out[3]", "layer_out[5]", "mismatch"), "last": ("final_norm", "final_norm", "ok")}
    for key in ("heatmap", "heatmap_right"):
        assert Path(r[key]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[3/7] applying demo-tiny-llama-eagle3" in p.stderr and "[7/7]" in p.stderr  # progress throughout
    assert not patch_status(engine="vllm")


def test_demo_refuses_a_folder_that_is_not_empty(tmp_path: Path):
    (tmp_path / "keep.txt").write_text("mine")
    p = subprocess.run([sys.executable, "-m", "surgeon", "demo", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "not empty" in p.stderr and (tmp_path / "keep.txt").read_text() == "mine"
