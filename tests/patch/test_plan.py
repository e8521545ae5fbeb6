"""`surgeon plan` on every release of the matrix, checked against a table read by hand.

Each row was checked by reading the release's source at the cited lines (the native route's checks,
the class's setter, the runner, the plugin loader): which route serves the draft, which writes the
dump, the ids each hands the engine, and the words of the check that refuses. The edge specs are
made here from the shipped llama spec: embed as an fc input, an fc order that is not ascending, a
dump of layer outputs only (declared in a non-ascending order), and pp 2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from surgeon.commands.outputs import OUTPUTS
from surgeon.core.spec import load_spec
from surgeon.engines.view import engine_session
from surgeon.patch.routes import plan
from surgeon.patch.routes.native import CPU_CONNECTOR, CPU_CONNECTOR_MODULE
from tests.conftest import release_engine

pytestmark = pytest.mark.engine

SPECS = Path(__file__).resolve().parents[2] / "specs"
LLAMA = (SPECS / "llama-3.1-8b-eagle3.yaml").read_text()
KIMI = (SPECS / "kimi-k2.5-eagle3.yaml").read_text()


def _edge(text: str, name: str, *edits: tuple[str, str]) -> str:
    out = text.split("engines:")[0].replace("name: llama-3.1-8b-eagle3", f"name: {name}")
    out = out.replace("name: kimi-k2.5-eagle3", f"name: {name}")
    for old, new in edits:
        assert old in out, old
        out = out.replace(old, new)
    return out


EDGES = {
    "llama": LLAMA,
    "kimi": KIMI,
    "qwen3": (SPECS / "qwen3-8b-eagle3.yaml").read_text(),
    "embed": _edge(LLAMA, "llama-embed", ("  low: layer_out[1]", "  low: embed"), ("layout: specforge, ", "")),
    "order": _edge(LLAMA, "llama-order", ("fc_input: [low, mid, high]", "fc_input: [mid, low, high]")),
    "layers": _edge(LLAMA, "llama-layers", ("slots: [low, mid, high, last]", "slots: [high, low, mid]")),
    "kimi-layers": _edge(KIMI, "kimi-layers", ("slots: [low, mid, high, last]", "slots: [low, mid, high]"),
                         ("layout: specforge, ", "")),
}

# (spec, release, pp) -> (recommended serve, recommended dump, {(route, need): (state, words in why, ids)})
# state W works, R refused, U undecided; words: a piece of the reason that names the check (file:line
# where the release's source has one).
V032, V011, V033, V034 = "vllm-installed", "vllm-0.11.0", "vllm-0.33.0", "vllm-0.34.0"
S023, S014, S005 = "sglang-installed", "sglang-0.5.14", "sglang-0.5.5"
FINAL_VLLM = "extract_hidden_states.py:"
TABLE = {
    ("kimi", V032, 1): ("config", "plugin", {
        ("config", "serve"): ("W", "", [3, 31, 59]),
        ("native", "dump"): ("R", "slot 'last' is final_norm", None),
        ("plugin", "dump"): ("W", "deepseek_v2.py", None)}),
    ("kimi", V011, 1): (None, "plugin", {
        ("config", "serve"): ("R", "defines no aux hidden-state capture", None),
        ("native", "dump"): ("R", "not found in vllm 0.11.0", None),
        ("plugin", "serve"): ("R", "no `return` of `aux_hidden_states`", None)}),
    ("kimi", V034, 2): (None, "plugin", {
        ("config", "serve"): ("R", "supports_aux_hidden_states_over_pp", None)}),
    ("kimi", S023, 1): ("config", "patch", {
        ("config", "serve"): ("W", "", [3, 31, 59]),
        ("native", "serve"): ("R", "validation_hook.py:", None),
        ("native", "dump"): ("R", "spec_aux_hidden_state.py:", None),
        ("plugin", "dump"): ("R", "registry.py:", None),
        ("patch", "serve"): ("R", "no `return` of `aux_hidden_states`", None),
        ("patch", "dump"): ("W", "--guard-bypass", None)}),  # the guard raises if two-batch overlap would run
    ("kimi", S014, 1): ("patch", "patch", {("config", "serve"): ("U", "deepseek_v2.py:", [3, 31, 59]),
                                         ("patch", "serve"): ("W", "--guard-bypass", None)}),
    ("kimi-layers", V032, 1): ("config", "plugin", {
        ("native", "dump"): ("U", "MLA when", [3, 31, 59])}),
    ("kimi-layers", S023, 1): ("config", "native", {
        ("native", "dump"): ("W", "--speculative-algorithm EAGLE3", [3, 31, 59])}),
    ("llama", V032, 1): ("config", "plugin", {
        ("config", "serve"): ("W", "", [2, 16, 29]),
        ("native", "dump"): ("R", FINAL_VLLM, None)}),
    ("llama", V032, 2): ("config", "plugin", {
        ("plugin", "dump"): ("W", "", None),
        ("plugin", "serve"): ("R", "earlier ranks", None)}),
    ("llama", S005, 1): ("config", "patch", {
        ("native", "dump"): ("R", "not found in sglang 0.5.5", None),
        ("plugin", "dump"): ("R", "not found in sglang 0.5.5", None)}),
    ("llama", S023, 2): (None, "patch", {("config", "serve"): ("R", "is_last_rank", None)}),
    ("qwen3", V011, 1): ("config", None, {("config", "serve"): ("W", "", [2, 18, 33])}),
    ("embed", V032, 1): ("config", "plugin", {("config", "serve"): ("W", "", [0, 16, 29])}),
    ("embed", S023, 1): ("config", "patch", {("config", "serve"): ("W", "", [-1, 15, 28])}),
    ("order", V034, 1): ("plugin", "plugin", {("config", "serve"): ("R", "sorts the ids", None)}),
    ("order", S023, 1): ("patch", "patch", {("plugin", "serve"): ("R", "registry.py:", None)}),
    ("layers", V033, 1): ("config", "native", {("native", "dump"): ("W", "", [2, 16, 29])}),
    ("layers", V034, 1): ("config", "native", {("native", "dump"): ("W", "", [2, 16, 29])}),
    ("layers", V011, 1): ("config", "plugin", {("native", "dump"): ("R", "not found in vllm 0.11.0", None)}),
    ("layers", S023, 1): ("config", "native", {("native", "dump"): ("W", "--speculative-algorithm EAGLE3",
                                                                    [1, 15, 28])}),
    ("layers", S014, 1): ("config", "patch", {("native", "dump"): ("R", "enable_return_hidden_states", None)}),
    ("layers", "trtllm", 1): ("config", "native", {("native", "dump"): ("W", "", [1, 15, 28, -1]),
                                                   ("patch", "dump"): ("R", "stub", None)}),
}
STATES = {"W": True, "R": False, "U": None}


def _root(label: str) -> tuple[str, str | None]:
    if label == "trtllm":
        return "trtllm", None
    engine, _, version = label.partition("-")
    return engine, None if version == "installed" else str(release_engine(engine, version))


@pytest.fixture(scope="module")
def session():
    with engine_session():
        yield


@pytest.fixture(scope="module")
def spec_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan-specs")
    out = {}
    for name, text in EDGES.items():
        (folder / f"{name}.yaml").write_text(text)
        out[name] = folder / f"{name}.yaml"
    return out


@pytest.mark.parametrize("key", list(TABLE), ids=lambda k: f"{k[0]}-{k[1]}-pp{k[2]}")
def test_plan_matches_the_hand_read_table(key, session, spec_files):
    spec_name, label, pp = key
    serve, dump, cells = TABLE[key]
    engine, root = _root(label)
    p = plan(load_spec(spec_files[spec_name]), engine, engine_root=root, pp=pp)
    assert p.recommended.get("serve") == serve, {r.route: r.verdicts.get("serve") for r in p.routes}
    assert p.recommended.get("dump") == dump, {r.route: r.verdicts.get("dump") for r in p.routes}
    for (route, need), (state, words, ids) in cells.items():
        v = p.route(route).verdicts[need]
        assert v.ok is STATES[state], (route, need, v)
        assert words in v.why, (route, need, v.why)
        if ids is not None:
            assert v.ids == ids, (route, need, v)
    # the first route that works is the recommendation, and a need with none gives exit 3 or 4
    for need, chosen in p.recommended.items():
        firsts = [r.route for r in p.routes if r.verdicts[need].ok is True]
        assert chosen == (firsts[0] if firsts else None)
    assert (p.exit_code == 0) == all(p.recommended.values())


def test_every_refusal_read_from_a_release_names_its_file_and_line(session, spec_files):
    """A refusal either cites file:line of the release (a rewriter's refusal: the file and the
    anchor, Class.method:site), or is one the route gives by its nature
    (a serving config writes no dump; the native path loads no draft; the search found nothing)."""
    by_nature = ("writes no dump", "loads no draft", "not found in", "TensorRT-LLM is not patched")
    for spec_name, label, pp in TABLE:
        engine, root = _root(label)
        p = plan(load_spec(spec_files[spec_name]), engine, engine_root=root, pp=pp)
        for r in p.routes:
            for need, v in r.verdicts.items():
                if v.ok is False and engine != "trtllm":
                    assert re.search(r"\.py(:\d+|: )", v.why) or any(w in v.why for w in by_nature), (r.route, need, v.why)


def test_native_dump_rows_are_in_the_order_the_engine_writes_them(session, spec_files):
    """dumps.slots says [high, low, mid]; the connector writes ascending ids: the verdict's names and
    points follow the file, which is what the sidecar records."""
    p = plan(load_spec(spec_files["layers"]), "vllm", engine_root=str(release_engine("vllm", "0.34.0")))
    v = p.route("native").verdicts["dump"]
    assert v.captures == ["layer_out[1]", "layer_out[15]", "layer_out[28]"] and v.names == ["low", "mid", "high"]
    cfg = p.route("native").config
    assert cfg["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert "--no-enable-prefix-caching" in p.route("native").launch


def test_cpu_launch_names_our_connector(session, spec_files):
    from surgeon.run.extract_runner import CONNECTOR_CLASS, CONNECTOR_MODULE

    assert (CPU_CONNECTOR, CPU_CONNECTOR_MODULE) == (CONNECTOR_CLASS, CONNECTOR_MODULE)
    p = plan(load_spec(spec_files["layers"]), "vllm", platform="cpu")
    kv = p.route("native").config["kv_transfer_config"]
    assert kv["kv_connector"] == CONNECTOR_CLASS and kv["kv_connector_module_path"] == CONNECTOR_MODULE
    assert any("pin" in h for h in p.route("native").hazards)


def test_plan_cli_json_sidecar_and_exit_codes(tmp_path, spec_files):
    from click.testing import CliRunner

    from surgeon.capture.sidecar import SIDECAR, read_sidecar
    from surgeon.cli import main

    dump_dir = tmp_path / "hs"
    r = CliRunner().invoke(main, ["plan", str(spec_files["layers"]), "--engine", "vllm", "--dump-dir", str(dump_dir),
                                  "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    OUTPUTS["plan"].model_validate(data)
    assert data["recommended"] == {"serve": "config", "dump": "native"}
    sc = read_sidecar(dump_dir / SIDECAR)
    assert sc.ids == (2, 16, 29) and sc.points == ("layer_out[1]", "layer_out[15]", "layer_out[28]")
    assert sc.names == ("low", "mid", "high") and sc.method == "extract_hidden_states" and sc.release == "0.32.0"
    assert data["sidecar"] == str(dump_dir / SIDECAR)
    # at pp 2 on vLLM 0.34 every route refuses to serve the Kimi draft (the config: deepseek_v2 lacks
    # supports_aux_hidden_states_over_pp; the hooks: fc points on earlier stages): exit 3
    r = CliRunner().invoke(main, ["plan", str(spec_files["kimi"]), "--engine", "vllm", "--pp", "2",
                                  "--engine-root", str(release_engine("vllm", "0.34.0"))])
    assert r.exit_code == 3, r.output
    assert "serve: no route works" in r.output
    # bad input: one line, exit 2
    r = CliRunner().invoke(main, ["plan", str(tmp_path / "missing.yaml"), "--engine", "vllm"])
    assert r.exit_code == 2 and "Traceback" not in r.output
