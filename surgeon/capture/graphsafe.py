"""A static checker for code that runs inside a captured CUDA graph (capture hooks).

``check_source(text, filename)`` parses Python source with libcst and reports, with 1-based line
and column, what would break CUDA-graph capture, force a host sync, or be skipped by graph
replay:

=================  ==========================================================================
``host-sync``      ``.item()``, ``.cpu()``, ``.tolist()``, ``.numpy()``, ``.to("cpu")``
                   (also ``device="cpu"``), ``torch.cuda.synchronize()``
``print``          ``print(...)`` of anything
``io``             ``torch.save``, ``torch.load``, ``open(...)``
``nondeterminism`` ``time.time()`` and friends, ``random.*``
``alloc``          ``torch.zeros/empty/ones/full/cat/stack/tensor/...`` in a function called per
                   step (every function except ``_alloc*`` and ``drain``)
``tensor-branch``  ``if`` / ``while`` / conditional expression / ``assert`` whose test depends on
                   a tensor value (per-step functions only), by a heuristic: the test calls a
                   reduction (``.any()``, ``.all()``, ``.sum()``, ...), or it compares, calls or
                   truth-tests a name bound from a function parameter other than ``module`` /
                   ``self`` and parameters annotated ``int`` / ``bool`` / ``str``. ``is`` /
                   ``is not`` tests, ``isinstance``/``len`` and ``.shape`` / ``.ndim`` /
                   ``.dtype`` / ``.device`` / ``.dim()`` / ``.size()`` are host values and pass.
=================  ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, PositionProvider

_SYNC_METHODS = {"item", "cpu", "tolist", "numpy"}
_ALLOC_FUNCS = {
    "zeros", "empty", "ones", "full", "cat", "concat", "concatenate", "stack", "tensor", "as_tensor",
    "zeros_like", "empty_like", "ones_like", "full_like", "arange", "randn", "rand", "empty_strided",
    "hstack", "vstack",
}
_REDUCTIONS = {"any", "all", "sum", "max", "min", "mean", "prod", "nonzero", "count_nonzero", "argmax",
               "argmin", "equal", "allclose", "isnan", "isinf", "item", "norm", "std", "var"}
_HOST_ATTRS = {"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad", "layout"}
_HOST_METHODS = {"dim", "size", "numel", "stride", "is_contiguous", "data_ptr", "element_size"}
_HOST_FUNCS = {"isinstance", "len", "hasattr", "getattr", "callable"}
_SAFE_ANNOTATIONS = {"int", "bool", "str", "float"}
_SAFE_PARAMS = {"module", "self", "cls"}
_TIME_FUNCS = {"time", "perf_counter", "monotonic", "time_ns", "perf_counter_ns", "process_time"}


@dataclass(frozen=True)
class Finding:
    line: int
    col: int
    rule: str
    message: str
    file: str = ""

    def __str__(self) -> str:
        where = f"{self.file}:" if self.file else ""
        return f"{where}{self.line}:{self.col}: {self.rule}: {self.message}"


def _dotted(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


def _is_cpu(node: cst.BaseExpression) -> bool:
    # isinstance rather than m.matches on the node itself, so that mypy sees the narrowed type
    if isinstance(node, cst.SimpleString) and node.evaluated_value in ("cpu", b"cpu"):
        return True
    return (isinstance(node, cst.Call)
            and m.matches(node.func, m.Attribute(value=m.Name("torch"), attr=m.Name("device")))
            and any(_is_cpu(a.value) for a in node.args))


_FROZEN_BRANCH = "Python control flow on a tensor value syncs the host and is frozen at capture"


def _names_in(node: cst.CSTNode) -> set[str]:
    """Every Name under ``node`` (the names an assignment target binds, or an expression reads)."""
    return {n.value for n in m.findall(node, m.Name()) if isinstance(n, cst.Name)}


class _Scope:
    def __init__(self, name: str, tainted: set[str]):
        self.name = name
        self.tainted = tainted

    @property
    def per_step(self) -> bool:
        return not (self.name.startswith("_alloc") or self.name == "drain")


class _Checker(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, filename: str):
        super().__init__()
        self.filename = filename
        self.findings: list[Finding] = []
        self.scopes: list[_Scope] = []

    # -- helpers -------------------------------------------------------------------------
    def _report(self, node: cst.CSTNode, rule: str, message: str) -> None:
        pos = self.get_metadata(PositionProvider, node).start
        self.findings.append(Finding(pos.line, pos.column + 1, rule, message, self.filename))

    @property
    def scope(self) -> _Scope | None:
        return self.scopes[-1] if self.scopes else None

    def _uses_tainted(self, node: cst.CSTNode) -> bool:
        """Whether ``node`` reads a tainted name other than through a host-valued attribute."""
        scope = self.scope
        if scope is None or not scope.tainted:
            return False
        tainted = scope.tainted  # the narrowed scope, for the visitor class below
        found = False

        class _V(cst.CSTVisitor):
            def visit_Attribute(self, n: cst.Attribute) -> bool:
                return n.attr.value not in _HOST_ATTRS

            def visit_Call(self, n: cst.Call) -> bool:
                if isinstance(n.func, cst.Attribute) and n.func.attr.value in _HOST_METHODS:
                    return False
                if isinstance(n.func, cst.Name) and n.func.value in _HOST_FUNCS:
                    return False
                return True

            def visit_Comparison(self, n: cst.Comparison) -> bool:
                return not all(isinstance(t.operator, (cst.Is, cst.IsNot)) for t in n.comparisons)

            def visit_Name(self, n: cst.Name) -> None:
                nonlocal found
                if n.value in tainted:
                    found = True

        node.visit(_V())
        return found

    def _check_test(self, test: cst.BaseExpression, node: cst.CSTNode, what: str) -> None:
        scope = self.scope
        if scope is None or not scope.per_step:
            return
        reductions = list(m.findall(test, m.Call(func=m.Attribute(attr=m.OneOf(*(m.Name(r) for r in _REDUCTIONS))))))
        reductions += m.findall(test, m.Call(func=m.Attribute(value=m.Name("torch"),
                                                              attr=m.OneOf(*(m.Name(r) for r in _REDUCTIONS)))))
        if reductions:
            self._report(node, "tensor-branch", f"{what} tests a tensor reduction: " + _FROZEN_BRANCH)
        elif self._uses_tainted(test):
            self._report(node, "tensor-branch", f"{what} tests a value computed from a tensor argument: " + _FROZEN_BRANCH)

    # -- scopes --------------------------------------------------------------------------
    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        tainted: set[str] = set()
        params = node.params
        for p in (*params.posonly_params, *params.params, *params.kwonly_params):
            name = p.name.value
            ann = _dotted(p.annotation.annotation) if p.annotation else None
            if name in _SAFE_PARAMS or ann in _SAFE_ANNOTATIONS:
                continue
            tainted.add(name)
        for star in (params.star_arg, params.star_kwarg):
            if isinstance(star, cst.Param):
                tainted.add(star.name.value)
        self.scopes.append(_Scope(node.name.value, tainted))

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.scopes.pop()

    def visit_Lambda(self, node: cst.Lambda) -> None:
        self.scopes.append(_Scope("<lambda>", {p.name.value for p in node.params.params}))

    def leave_Lambda(self, original_node: cst.Lambda) -> None:
        self.scopes.pop()

    def _bind(self, target: cst.BaseExpression, value: cst.BaseExpression | None) -> None:
        scope = self.scope
        if scope is None or value is None:
            return
        names = _names_in(target) if not isinstance(target, cst.Attribute) else set()
        if self._uses_tainted(value):
            scope.tainted |= names
        else:
            scope.tainted -= names

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._bind(t.target, node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._bind(node.target, node.value)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        if self.scope is not None and self._uses_tainted(node.value):
            self.scope.tainted |= _names_in(node.target)

    def visit_For(self, node: cst.For) -> None:
        self._bind(node.target, node.iter)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._bind(node.target, node.value)

    # -- control flow --------------------------------------------------------------------
    def visit_If(self, node: cst.If) -> None:
        self._check_test(node.test, node, "if")

    def visit_While(self, node: cst.While) -> None:
        self._check_test(node.test, node, "while")

    def visit_IfExp(self, node: cst.IfExp) -> None:
        self._check_test(node.test, node, "conditional expression")

    def visit_Assert(self, node: cst.Assert) -> None:
        self._check_test(node.test, node, "assert")

    # -- calls and attributes ------------------------------------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        dotted = _dotted(func)
        if isinstance(func, cst.Attribute):
            attr = func.attr.value
            if attr in _SYNC_METHODS:
                self._report(node, "host-sync",
                             f".{attr}() copies a tensor to the host (device sync; not replayed by a CUDA graph)")
            elif attr == "to" and any(_is_cpu(a.value) for a in node.args if a.keyword is None or a.keyword.value == "device"):
                self._report(node, "host-sync", '.to("cpu") copies a tensor to the host (device sync)')
        if dotted == "print":
            self._report(node, "print", "print() runs on the host at capture only, and formatting a tensor syncs")
        elif dotted in ("torch.save", "torch.load"):
            self._report(node, "io", f"{dotted}() is host file I/O (syncs; never replayed)")
        elif dotted in ("open", "io.open"):
            self._report(node, "io", "open() is host file I/O (never replayed)")
        elif dotted in ("torch.cuda.synchronize", "torch.cuda.current_stream().synchronize"):
            self._report(node, "host-sync", f"{dotted}() blocks the host (illegal during capture)")
        elif dotted and dotted.startswith("time.") and dotted.split(".", 1)[1] in _TIME_FUNCS:
            self._report(node, "nondeterminism", f"{dotted}() is a host value frozen at capture")
        elif dotted and dotted.startswith("torch.") and dotted.split(".", 1)[1] in _ALLOC_FUNCS:
            scope = self.scope
            if scope is not None and scope.per_step:
                self._report(node, "alloc",
                             f"{dotted}() allocates a tensor every step: preallocate it in an _alloc* function and write into it")

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if m.matches(node.value, m.Name("random")):
            self._report(node, "nondeterminism", f"random.{node.attr.value} is host randomness, frozen at capture")


def check_source(text: str, filename: str = "<string>") -> list[Finding]:
    """Findings for Python source ``text`` (a syntax error is one finding, rule ``syntax``)."""
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as e:
        return [Finding(e.raw_line, e.raw_column + 1, "syntax", e.message, filename)]
    checker = _Checker(filename)
    MetadataWrapper(module).visit(checker)
    return sorted(checker.findings, key=lambda f: (f.line, f.col, f.rule))


def check_file(path: str | Path) -> list[Finding]:
    p = Path(path)
    return check_source(p.read_text(encoding="utf-8"), str(p))


def main(argv: list[str] | None = None) -> int:
    """``python -m surgeon.capture.graphsafe FILE...``: print findings; exit 1 if any, 2 if unreadable."""
    import sys

    paths = sys.argv[1:] if argv is None else argv
    status = 0
    for path in paths:
        try:
            findings = check_file(path)
        except (OSError, UnicodeDecodeError) as e:
            print(f"{path}: cannot read: {e}", file=sys.stderr)
            status = 2
            continue
        for f in findings:
            print(f)
        if findings and status == 0:
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
