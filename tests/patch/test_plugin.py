"""Plugin delivery (``surgeon apply --deliver plugin``), on the real engine files: the installed
vLLM 0.32.0 and the unpacked releases under .engines/ (vllm-0.11.0, vllm-0.34.0, sglang-*).

What could go wrong and is checked: the builder writes under the engine root; the carried module
keeps a relative import or still imports the hooks from the engine package; the manifest records
another file's sha256; a non-empty folder that is not a previous build is overwritten; importlib
cannot find the entry point with only the folder on the path (or after pip install); at engine start
the plugin installs nothing, or installs over a changed engine file or another release instead of
refusing; SGLang is refused without its reason and file:line.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import libcst as cst
import libcst.matchers as m
import pytest

from surgeon.core.errors import BadInput
from surgeon.engines.source.locate import locate_engine
from surgeon.patch.plugin import build_plugin, plugin_names

REPO = Path(__file__).resolve().parents[2]
ENGINES = REPO / ".engines"
DEMO = REPO / "specs" / "demo-tiny-llama-eagle3.yaml"
QWEN3 = REPO / "specs" / "qwen3-8b-eagle3.yaml"
LLAMA = REPO / "specs" / "llama-3.1-8b-eagle3.yaml"

pytestmark = pytest.mark.engine


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def release(name: str) -> Path:
    root = ENGINES / name / name.split("-")[0]
    if not root.is_dir():
        pytest.skip(f"{root} is not unpacked here")
    return root


@pytest.fixture(scope="module")
def vllm_root() -> Path:
    return Path(locate_engine("vllm", None).root)


@pytest.fixture(scope="module")
def demo_build(tmp_path_factory, vllm_root):
    out = tmp_path_factory.mktemp("plugin") / "demo"
    before = digest(vllm_root / "model_executor" / "models")
    build = build_plugin(DEMO, engine="vllm", out=out, max_tokens=128)
    assert digest(vllm_root / "model_executor" / "models") == before  # the engine root is only read
    return build


def test_the_manifest_records_the_pristine_file_and_the_release(demo_build, vllm_root):
    b = demo_build
    pkg = b.out / b.package
    manifest = json.loads((pkg / "manifest.json").read_text())
    [mod] = manifest["modules"]
    assert mod["module"] == "vllm.model_executor.models.llama" and mod["loop_class"] == "LlamaModel"
    assert mod["sha256"] == hashlib.sha256((vllm_root / "model_executor/models/llama.py").read_bytes()).hexdigest()
    assert mod["carried_sha256"] == hashlib.sha256((pkg / mod["file"]).read_bytes()).hexdigest()
    assert manifest["engine_version"] == "0.32.0" and manifest["version_pin"] == "==0.32.0"
    assert "LlamaForCausalLM" in manifest["architectures"] and manifest["spec"]["name"] == "demo-tiny-llama-eagle3"
    assert (pkg / "_surgeon_plugin_runtime.py").read_bytes() == (REPO / "surgeon/patch/pluginruntime.py").read_bytes()


def test_the_carried_module_imports_absolutely_and_its_hooks_from_the_package(demo_build, vllm_root):
    b = demo_build
    source = (b.out / b.package / b.modules[0].file).read_text()
    tree = cst.parse_module(source)
    assert m.findall(tree, m.ImportFrom()), "the carried module lost its imports"
    assert not m.findall(tree, m.ImportFrom(relative=[m.AtLeastN(n=1)])), "a relative import is left"
    original = (vllm_root / "model_executor/models/llama.py").read_text()
    assert "from .utils import" in original and "from vllm.model_executor.models.utils import" in source
    assert b.hooks_module == f"{b.package}._surgeon_hooks_demo_tiny_llama_eagle3"
    assert f"import {b.hooks_module}\n" in source and f"{b.hooks_module}.capture_position(" in source
    assert "vllm.model_executor.models._surgeon_hooks" not in source


def test_importlib_finds_the_entry_point_with_only_the_folder_on_the_path(demo_build):
    b = demo_build
    [dist] = [d for d in importlib.metadata.distributions(path=[str(b.out)])]
    assert dist.metadata["Name"] == "surgeon-plugin-demo-tiny-llama-eagle3"
    [ep] = [e for e in dist.entry_points if e.group == "vllm.general_plugins"]
    assert ep.value == f"{b.package}._surgeon_plugin_runtime:register"
    for line in (b.out / b.names.dist_info / "RECORD").read_text().splitlines()[:-1]:
        rel, sha, size = line.split(",")
        assert (b.out / rel).stat().st_size == int(size)


def test_the_loop_owner_in_another_file_is_the_module_carried(tmp_path, vllm_root):
    b = build_plugin(QWEN3, engine="vllm", out=tmp_path / "q")
    assert [c.module for c in b.modules] == ["vllm.model_executor.models.qwen2"]
    assert b.modules[0].loop_class == "Qwen2Model" and "Qwen3ForCausalLM" in b.architectures


@pytest.mark.parametrize("name", ["vllm-0.11.0", "vllm-0.34.0"])
def test_release_sources_are_read_never_written(tmp_path, name):
    root = release(name)
    before = digest(root / "model_executor" / "models")
    b = build_plugin(LLAMA, engine="vllm", engine_root=root, out=tmp_path / "p")
    assert digest(root / "model_executor" / "models") == before
    assert b.engine_version == name.split("-")[1]
    assert b.modules[0].sha256 == before["llama.py"]


def test_the_output_folder_rules(tmp_path, demo_build):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(BadInput, match="not a previous build"):
        build_plugin(DEMO, engine="vllm", out=busy)
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    with pytest.raises(BadInput, match="not a previous build of plugin surgeon_plugin_qwen3_8b_eagle3"):
        build_plugin(QWEN3, engine="vllm", out=demo_build.out)  # another spec's plugin is not replaced
    again = build_plugin(DEMO, engine="vllm", out=demo_build.out, max_tokens=128)
    assert again.replaced and (again.out / again.package / "manifest.json").is_file()
    assert not [p for p in again.out.parent.iterdir() if p.name.startswith(".")]  # no temporary left
    root = release("vllm-0.34.0")
    with pytest.raises(BadInput, match="overlaps the engine root"):
        build_plugin(LLAMA, engine="vllm", engine_root=root, out=root / "surgeon_plugin")
    assert not (root / "surgeon_plugin").exists()
    with pytest.raises(BadInput, match="not a folder"):
        build_plugin(DEMO, engine="vllm", out=busy / "notes.txt")


def test_names_are_identifiers_derived_from_the_spec_name():
    n = plugin_names("Kimi-K2.5 eagle3/v2")
    assert n.package == "surgeon_plugin_kimi_k2_5_eagle3_v2" and n.package.isidentifier()
    assert n.distribution == "surgeon-plugin-kimi-k2-5-eagle3-v2"


@pytest.mark.parametrize("name, expect", [
    ("sglang-0.5.5", r"never reads SGLANG_EXTERNAL_MODEL_PACKAGE"),
    ("sglang-0.5.14", r"SGLANG_EXTERNAL_MODEL_PACKAGE, srt/models/registry.py:\d+\) but its import_model_classes "
                      r"\(srt/models/registry.py:\d+\)"),
])
def test_sglang_is_refused_with_the_reason_and_file_line(tmp_path, name, expect):
    with pytest.raises(BadInput, match=expect):
        build_plugin(DEMO, engine="sglang", engine_root=release(name), out=tmp_path / "s")
    assert not (tmp_path / "s").exists()


RUNTIME_CHECKS = textwrap.dedent("""
    import importlib.util, json, sys
    from pathlib import Path
    out = {}
    for i, folder in enumerate(json.loads(sys.argv[1])):
        spec = importlib.util.spec_from_file_location(f"rt{i}", Path(folder) / "_surgeon_plugin_runtime.py")
        rt = importlib.util.module_from_spec(spec); spec.loader.exec_module(rt)
        try:
            out[folder] = ["ok", [c["module"] for c in rt.check(Path(folder))]]
        except rt.PluginRefused as e:
            out[folder] = ["refused", str(e)]
    # a refusing register() stops the start and poisons the module for any later start here
    try:
        rt.register.__globals__["__file__"] = str(Path(sys.argv[2]) / "_surgeon_plugin_runtime.py")
        rt.register()
        out["poison"] = "registered"
    except rt.PluginRefused as e:
        import vllm.model_executor.models.llama as L
        try:
            L.LlamaForCausalLM
            out["poison"] = "not poisoned"
        except rt.PluginRefused as again:
            out["poison"] = [str(e) == str(again), type(L).__name__]
    print(json.dumps(out))
""")

INSTALLED = textwrap.dedent("""
    import json, sys
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import vllm.model_executor.models.llama as L
    import vllm.model_executor.models as models
    hooks = sorted(n for n in sys.modules if "_surgeon_hooks" in n)
    print(json.dumps([L.__file__, L.LlamaModel.__module__, models.llama is L, hooks]))
""")


def _child(code: str, *args: str, path: Path | None = None) -> object:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path)] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_at_engine_start_the_plugin_installs_the_patched_module(demo_build):
    b = demo_build
    file, module, bound, hooks = _child(INSTALLED, path=b.out)
    assert Path(file) == b.out / b.package / b.modules[0].file and module == "vllm.model_executor.models.llama"
    assert bound and hooks == [b.hooks_module]


@pytest.mark.slow
def test_a_changed_file_or_another_release_is_refused_in_one_line(tmp_path, demo_build, vllm_root):
    import shutil

    good = demo_build.out / demo_build.package
    drift = tmp_path / "drift" / demo_build.package
    shutil.copytree(good, drift)
    manifest = json.loads((drift / "manifest.json").read_text())
    recorded = hashlib.sha256(b"another llama.py").hexdigest()
    manifest["modules"][0]["sha256"] = recorded
    (drift / "manifest.json").write_text(json.dumps(manifest))
    other = build_plugin(LLAMA, engine="vllm", engine_root=release("vllm-0.34.0"), out=tmp_path / "rel")
    folders = [str(good), str(drift), str(other.out / other.package)]
    res = _child(RUNTIME_CHECKS, json.dumps(folders), str(drift))
    assert res[str(good)] == ["ok", ["vllm.model_executor.models.llama"]]
    state, msg = res[str(drift)]
    found = hashlib.sha256((vllm_root / "model_executor/models/llama.py").read_bytes()).hexdigest()
    assert state == "refused" and "model_executor/models/llama.py" in msg and recorded in msg and found in msg
    assert "\n" not in msg
    state, msg = res[str(other.out / other.package)]
    assert state == "refused" and "built for vllm 0.34.0 but 0.32.0 is installed" in msg
    assert res["poison"] == [True, "_Refused"]


@pytest.mark.slow
def test_pip_installs_the_folder(tmp_path, demo_build):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                        "--quiet", "--target", str(target), str(demo_build.out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    [dist] = list(importlib.metadata.distributions(path=[str(target)]))
    assert [e.value for e in dist.entry_points if e.group == "vllm.general_plugins"] == [
        f"{demo_build.package}._surgeon_plugin_runtime:register"]
    assert (target / demo_build.package / "manifest.json").is_file()
    assert (target / demo_build.package / demo_build.modules[0].file).is_file()
