"""The pre-commit hooks as pre-commit runs them: every YAML file of a repository is passed to the
hook's entry, which must lint the specs among them (found by content, in any folder) and leave the
other YAML alone."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from surgeon.core.spec import is_spec_file

REPO = Path(__file__).resolve().parents[2]
HOOKS = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())


def test_hooks_find_specs_anywhere_and_one_uses_the_installed_engines():
    by_id = {h["id"]: h for h in HOOKS}
    assert set(by_id) == {"surgeon-lint", "surgeon-lint-installed"}
    for h in HOOKS:
        assert "files" not in h and h["types"] == ["yaml"], h  # not only ^specs/: every YAML, sorted by content
        assert "--skip-non-specs" in h["entry"]
    assert by_id["surgeon-lint"]["language"] == "python"
    assert by_id["surgeon-lint-installed"]["language"] == "system"  # the project's surgeon and engines: pins checked


def _run_entry(hook_id: str, files: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    (hook,) = [h for h in HOOKS if h["id"] == hook_id]
    argv = shlex.split(hook["entry"])
    assert argv[0] == "surgeon"
    return subprocess.run([sys.executable, "-m", "surgeon", *argv[1:], *map(str, files)], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture
def repo(tmp_path: Path) -> dict[str, Path]:
    files = {
        "spec": tmp_path / "deploy" / "kimi" / "draft.yaml",
        "workflow": tmp_path / ".github" / "workflows" / "ci.yml",
        "config": tmp_path / "config.yaml",
    }
    for f in files.values():
        f.parent.mkdir(parents=True, exist_ok=True)
    files["spec"].write_text((REPO / "specs" / "kimi-k2.5-eagle3.yaml").read_text())
    files["workflow"].write_text("name: ci\non: [push]\njobs: {test: {runs-on: ubuntu-latest, steps: []}}\n")
    files["config"].write_text("# spec: not a key here\nspecs: [a, b]\nname: x\n")
    return files


@pytest.mark.parametrize("hook_id", ["surgeon-lint", "surgeon-lint-installed"])
def test_hook_entry_lints_the_specs_among_all_yaml(repo, tmp_path, hook_id):
    assert [is_spec_file(f) for f in repo.values()] == [True, False, False]
    r = _run_entry(hook_id, list(repo.values()), tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "draft.yaml" in out and "ci.yml" not in out and "config.yaml" not in out
    assert "model_forward_stages" in out  # the deepseek two-batch-overlap warning, engine or not

    broken = tmp_path / "other" / "broken.yml"
    broken.parent.mkdir()
    broken.write_text("spec: 1\nname: broken\ntarget: {architecture: LlamaForCausalLM, num_layers: 4}\n")
    r = _run_entry(hook_id, [*repo.values(), broken], tmp_path)
    assert r.returncode == 2 and "broken.yml:" in r.stdout + r.stderr


def _site_without_engines(dest: Path) -> Path:
    """This environment's site-packages as surgeon-lint's own hook environment has it: every
    distribution but the engines (symlinks; no .pth file, so surgeon comes from the checkout)."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    dest.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith(("sglang", "vllm")) and entry.suffix != ".pth":
            (dest / entry.name).symlink_to(entry)
    return dest


def test_the_hook_without_engines_refuses_an_architecture_its_table_does_not_know(repo, tmp_path):
    """surgeon-lint's environment has no engine (the built-in table answers): an architecture the
    table has no row for is an error located at target.architecture (exit 2), never the Llama row;
    one it has passes, with the same two-batch-overlap warning as with the engines."""
    site = _site_without_engines(tmp_path / "site")
    (hook,) = [h for h in HOOKS if h["id"] == "surgeon-lint"]
    argv = shlex.split(hook["entry"])
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    text = (REPO / "specs" / "llama-3.1-8b-eagle3.yaml").read_text().split("engines:")[0]
    spec = tmp_path / "deploy" / "qwen4.yaml"
    spec.write_text(text.replace("LlamaForCausalLM", "Qwen4ForCausalLM"))

    def run(*files: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-S", "-m", "surgeon", *argv[1:], "--strict", *map(str, files)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)

    r = run(spec, *repo.values())
    line = next(n for n, t in enumerate(text.splitlines(), 1) if "architecture:" in t)
    col = text.splitlines()[line - 1].index("LlamaForCausalLM") + 1
    errors = [x for x in r.stderr.splitlines() if x.startswith(f"{spec}:{line}:{col}: target.architecture: ")]
    assert r.returncode == 2 and len(errors) == 2, r.stdout + r.stderr
    assert all("not installed here" in x and "no row for Qwen4ForCausalLM" in x and "pip install --no-deps" in x
               for x in errors), errors
    assert "Traceback" not in r.stderr and "scripts/" not in r.stdout + r.stderr
    ok = run(*repo.values())  # the kimi spec: DeepseekV3ForCausalLM has a row in both tables
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "built-in table, srt/models/deepseek_v2.py:3518 DeepseekV3ForCausalLM" in ok.stdout
    assert "model_forward_stages" in ok.stdout + ok.stderr and "llama.py" not in ok.stdout
