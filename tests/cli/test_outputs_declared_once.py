"""Each ``--json`` output is declared once, in its pydantic model (``surgeon.commands.outputs``):
no result builds its JSON by hand, the CLI prints every output through :func:`json_output`, and a
result that does not fill its model is an internal error, never a silently different JSON. (The
real outputs of every verb are validated against the printed schemas in ``test_json_contract``.)"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest

from surgeon.commands import outputs
from surgeon.commands.outputs import FORMATS, OUTPUTS, json_output, output_of
from surgeon.core.errors import InternalError

PACKAGE = Path(__file__).resolve().parents[2] / "surgeon"
HAND_WRITTEN = {"to_json", "as_json", "to_dict", "json_dict"}


def _functions(tree: ast.AST):
    return (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))


def test_no_result_writes_its_own_json():
    found = [f"{path.relative_to(PACKAGE.parent)}:{fn.lineno} {fn.name}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for fn in _functions(ast.parse(path.read_text(), str(path))) if fn.name in HAND_WRITTEN]
    assert not found, found


def test_output_of_reads_the_model_only():
    """No fallback to anything the result says its JSON is: the model reads attributes."""
    src = inspect.getsource(outputs.output_of)
    assert "to_json" not in src and "from_attributes=True" in src


def test_the_cli_prints_every_output_through_its_model():
    """``--json`` goes through ``commands.json_output`` in one place (``cli._show``), and every
    ``emit_json`` call outside it prints the schema command's schema, not a result's own dict."""
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "emit_json"]
    via_model = [c for c in calls if isinstance(c.args[0], ast.Call) and getattr(c.args[0].func, "attr", None) == "json_output"]
    assert len(via_model) == 1
    others = [ast.unparse(c.args[0]) for c in calls if c not in via_model]
    assert others == ["result.schema"], others
    assert set(FORMATS) == set(OUTPUTS)


@dataclass
class _Finding:
    file: str
    line: int
    col: int
    rule: str
    message: str


@dataclass
class _HookCheck:
    ok: bool
    findings: list


def test_a_result_is_read_by_attribute_names_and_printed_under_its_format():
    data = json_output("check-hooks", _HookCheck(ok=False, findings=[_Finding("h.py", 3, 1, "G001", "sync")]))
    assert data["format"] == FORMATS["check-hooks"] and data["ok"] is False
    assert data["findings"][0]["line"] == 3


def test_a_result_that_does_not_fill_its_model_is_an_internal_error():
    @dataclass
    class Missing:
        ok: bool

    with pytest.raises(InternalError, match=r"check-hooks result does not fill its --json model: findings"):
        output_of("check-hooks", Missing(ok=True))

    @dataclass
    class Mistyped:
        ok: bool
        findings: list

    with pytest.raises(InternalError, match=r"findings\.0\.line"):
        output_of("check-hooks", Mistyped(ok=True, findings=[_Finding("h.py", "three", 1, "G001", "x")]))  # type: ignore[arg-type]
