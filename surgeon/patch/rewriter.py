"""libcst rewriter: insert capture-hook calls into an engine's decoder-model forward.

:func:`rewrite` is a pure function from source bytes to new source bytes. It inserts, into the
method that holds the decoder-layer loop, calls of a generated hooks module::

    begin_step(self, num_tokens)                          first statement of the method
    capture_position(self, 0, hidden_states, residual)    before the loop (only if 0 requested)
    capture_position(self, <idx> + 1, hidden_states, residual)
                                                          after the layer call in the loop body
    capture_final(self, hidden_states)                    after the final-norm assignment

plus one ``import <hooks_module>`` after the last top-level import. The capture before the loop is
guarded by ``if <first layer of the loop> == 0:`` (a later pipeline rank enters with
``layer_out[start - 1]``, not the embedding). Index-less loops (``for layer in self.layers[a:b]``)
get an iteration counter (``_surgeon_layer``, from the slice start). SGLang 0.5.23 layer-boundary
models keep the residual in ``forward_batch.residual_stream`` (``hidden_states`` after a layer may
be an OwedOutput handle); there the stream is read as
``residual_batch.snapshot(hidden_states, forward_batch)`` (residual None), only under
``if <pos> in {requested}:`` because a snapshot costs kernels and, under TP, a collective. Every other byte of the file
round-trips (libcst keeps formatting). Inserted code is built from libcst nodes; names and
expressions from recipes are parsed as expressions and restricted to names, attributes,
subscripts and integers, never formatted into source text.

It refuses (:class:`PatchApplicationError`, naming the file and the anchor) when an anchor
matches zero or several places, when the loop variable is not the global layer index, when the
residual stream cannot be read as a local, or when the method runs decoder layers through a
second path (a ``self.layers[a:b]`` slice handed to something else, the list handed to another
call, a layer called outside the loop) that would skip captures, unless ``guard_bypass``: then a
``bypass_guard(self, first, last, "file:line")`` call goes right before each such statement, in its
block; at runtime it raises when a requested ``layer_out[k]`` with ``first <= k < last`` would run
there (SGLang two-batch overlap: ``self.layers[normal_end_layer : self.end_layer]`` gives
``normal_end_layer, self.end_layer``; the whole list ``0, len(self.layers)``; unreadable bounds
``0, <hooks>.NUM_LAYERS``). Bounds are re-read only when they are names, attributes, subscripts,
non-negative integers, sums or ``len(...)``; the check is on host ints (graph safe).

Recipes (``patches/*.yaml``) are data: per engine and model file/class they override what the
generic recognizer would pick. Without a recipe the generic one (:data:`GENERIC`) applies.

Layers: the loop is read by :mod:`surgeon.engines.source.anatomy`, the insertions are decided by
:mod:`surgeon.patch.planner` (which refuses), recipes and the source reducer live in
:mod:`surgeon.patch.recipes`; this module only inserts the planned statements and splices the
result into the original bytes. The names other modules import from here are re-exported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst

from surgeon.engines.source.anatomy import COUNTER
from surgeon.patch.markers import Marker
from surgeon.patch.planner import AUX_NAME, CapturePlanner, Checker, check, hooks_expr
from surgeon.patch.recipes import (
    GENERIC,
    PatchApplicationError,
    Recipe,
    class_spans,
    find_recipe,
    load_recipes,
    parse,
    parse_reduced,
    reduce_to_spans,
)

__all__ = [
    "AUX_NAME",
    "COUNTER",
    "GENERIC",
    "Checker",
    "PatchApplicationError",
    "Recipe",
    "RewriteResult",
    "check",
    "find_recipe",
    "load_recipes",
    "parse",
    "parse_reduced",
    "reduce_to_spans",
    "rewrite",
]

# what a Module's body holds: the statements _splice_edit reads back byte for byte
TopStatement = cst.SimpleStatementLine | cst.BaseCompoundStatement
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class RewriteResult:
    new_bytes: bytes
    anchors: list[str] = field(default_factory=list)  # "Class.method:what@line" per insertion
    inserted: int = 0  # statements inserted (the import included)



class _Insert(cst.CSTTransformer):
    def __init__(self, before, after, import_after: cst.CSTNode | None, import_stmt: TopStatement):
        self.before, self.after = before, after
        self.import_after, self.import_stmt = import_after, import_stmt

    def _splice(self, original_body, updated_body):
        out = []
        for o, u in zip(original_body, updated_body):
            out += self.before.get(o, [])
            out.append(u)
            out += self.after.get(o, [])
            if o is self.import_after:
                out.append(self.import_stmt)
        return out

    def leave_IndentedBlock(self, original_node, updated_node):
        return updated_node.with_changes(body=self._splice(original_node.body, updated_node.body))

    def leave_Module(self, original_node, updated_node):
        return updated_node.with_changes(body=self._splice(original_node.body, updated_node.body))



def _stmt_code(module: cst.Module, stmt: TopStatement) -> bytes:
    """The bytes a top-level statement occupies in ``module``'s code (its leading lines included)."""
    return cst.Module(body=[stmt], default_indent=module.default_indent,
                      default_newline=module.default_newline).code.encode(module.encoding)



def _line_starts(source: bytes) -> list[int]:
    """Byte offset of the start of each line (1-based line k starts at [k - 1]), and the end."""
    out = [0]
    for line in source.splitlines(keepends=True):
        out.append(out[-1] + len(line))
    return out


def _strip_trailing_blank(text: bytes) -> bytes:
    lines = text.splitlines(keepends=True)
    while lines and not lines[-1].strip():
        lines.pop()
    return b"".join(lines)



def rewrite(source_bytes: bytes, *, relpath: str, class_name: str | None, positions: set[int],
            capture_final: bool, hooks_module: str = "_surgeon_hooks",
            recipe: Recipe | None = None, guard_bypass: bool = False, aux_return: bool = False,
            marker: Marker | None = None) -> RewriteResult:
    """Insert capture-hook calls into the decoder model's forward; see the module docstring.

    ``marker``: the patch's :class:`surgeon.patch.markers.Marker`, put as a comment (a libcst
    ``Comment`` node) above the hooks import, so the patched file says which patch it carries.

    ``guard_bypass``: where the method runs decoder layers outside the capture loop (SGLang's
    two-batch overlap), insert ``bypass_guard(self, first, last, "file:line")`` before that
    statement instead of refusing: at runtime it raises when a requested ``layer_out[k]`` with
    ``first <= k < last`` would run there (all requested layers when the bounds are not readable).

    ``aux_return`` (aux mode): before each ``return`` of ``aux_hidden_states`` insert
    ``if aux_hidden_states: aux_hidden_states = [<hooks>.aux_hidden_states(self)]``, so that when
    the engine asked for aux states (an EAGLE-3 draft is configured) its draft path receives the
    spec's fc input, in fc order, as one ``[T, n_fc * H]`` tensor (the engines concatenate the list).

    Speed: libcst parses only the top-level imports and the class(es) concerned (the other lines
    emptied, line numbers kept; the stdlib ``ast`` finds them); positions and parents are resolved
    for the one method only; the insertions transform that method alone, and only the code of its
    class and of the hooks import is generated and spliced into the original bytes at their lines.
    Where any step of that is not exact, the whole file is parsed and generated: the same bytes."""
    if not _DOTTED.fullmatch(hooks_module) or any(p in ("self", "None", "True", "False") for p in hooks_module.split(".")):
        raise ValueError(f"hooks_module must be a dotted module name, not {hooks_module!r}")
    if any(p < 0 for p in positions):
        raise ValueError(f"positions are >= 0, got {sorted(positions)}")
    recipe = recipe or GENERIC
    reduced = parse_reduced(source_bytes, class_spans(source_bytes, class_name, recipe))
    if reduced is not None:
        module, text = reduced
        new = _rewrite(module, text, source_bytes, relpath=relpath, class_name=class_name, positions=positions,
                       capture_final=capture_final, hooks_module=hooks_module, recipe=recipe,
                       guard_bypass=guard_bypass, aux_return=aux_return, marker=marker)
        if new is not None:
            return new
    return _rewrite(parse(source_bytes, relpath), source_bytes, source_bytes, relpath=relpath, class_name=class_name,
                    positions=positions, capture_final=capture_final, hooks_module=hooks_module, recipe=recipe,
                    guard_bypass=guard_bypass, aux_return=aux_return, marker=marker)  # type: ignore[return-value]  # unreduced: never None


def _last_import(module: cst.Module) -> cst.SimpleStatementLine | None:
    last = None
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body):
            last = stmt
    return last


def _splice_edit(module: cst.Module, source_bytes: bytes, src_lines: list[int], line: int,
                 old_node: TopStatement, new_node: TopStatement | None,
                 import_stmt: TopStatement) -> tuple[int, int, bytes] | None:
    """The byte range of ``old_node`` in ``source_bytes`` (starting at ``line``) and what replaces
    it: its new code (``new_node``), or, for the last import (``new_node`` None), the hooks import
    inserted right after it. None where the node's code is not found there byte for byte."""
    old = _stmt_code(module, old_node.with_changes(leading_lines=()))
    core = _strip_trailing_blank(old) if new_node is not None else old
    first = line - 1
    n = len(core.splitlines())
    if first + n >= len(src_lines) or source_bytes[src_lines[first]:src_lines[first + n]] != core:
        return None
    if new_node is None:
        return src_lines[first + n], src_lines[first + n], _stmt_code(module, import_stmt)
    text = _stmt_code(module, new_node.with_changes(leading_lines=()))
    tail = old[len(core):]
    if not text.endswith(tail):
        return None
    return src_lines[first], src_lines[first + n], text[:len(text) - len(tail)]


def _splice(module: cst.Module, source_bytes: bytes, planner: CapturePlanner, cls: cst.ClassDef,
            new_cls: cst.ClassDef, last_import: cst.SimpleStatementLine,
            import_stmt: TopStatement) -> bytes | None:
    """Splice by lines: the class and the last import without their leading lines (emptied where
    the parse was reduced), and without the class's trailing blank lines (its footer there).
    None where that is not exact."""
    src_lines = _line_starts(source_bytes)
    edits = []
    for old_node, new_node in ((cls, new_cls), (last_import, None)):
        edit = _splice_edit(module, source_bytes, src_lines, planner.line(old_node), old_node, new_node, import_stmt)
        if edit is None:
            return None
        edits.append(edit)
    edits.sort()
    if edits[0][1] > edits[1][0]:
        return None
    parts, pos = [], 0
    for a, b, text in edits:
        parts += [source_bytes[pos:a], text]
        pos = b
    parts.append(source_bytes[pos:])
    return b"".join(parts)


def _regenerate(module: cst.Module, cls: cst.ClassDef, new_cls: cst.ClassDef, last_import: cst.CSTNode,
                import_stmt: TopStatement) -> bytes:
    """The whole module's code with the class replaced and the hooks import added."""
    body: list[cst.BaseStatement] = []
    for s in module.body:
        body.append(new_cls if s is cls else s)
        if s is last_import:
            body.append(import_stmt)
    return module.with_changes(body=body).code.encode(module.encoding)


def _rewrite(module: cst.Module, parsed: bytes, source_bytes: bytes, *, relpath: str, class_name: str | None,
             positions: set[int], capture_final: bool, hooks_module: str, recipe: Recipe,
             guard_bypass: bool, aux_return: bool = False, marker: Marker | None = None) -> RewriteResult | None:
    """The rewrite of ``source_bytes`` from ``module``, the parse of ``parsed`` (the same lines,
    some emptied, or the same bytes). None when ``parsed`` is reduced and the splice is not exact."""
    planner = CapturePlanner(module, relpath, class_name, recipe, parsed)
    plan = planner.plan(set(positions), capture_final, hooks_expr(hooks_module), guard_bypass=guard_bypass,
                        aux_return=aux_return)
    anatomy = planner.candidates()[0]
    cls, fn = anatomy.cls, anatomy.fn
    last_import = _last_import(module)
    import_stmt = cst.SimpleStatementLine([cst.Import(names=[cst.ImportAlias(name=hooks_expr(hooks_module))])],  # type: ignore[arg-type]  # a Name/Attribute chain
                                          leading_lines=[cst.EmptyLine(comment=cst.Comment(marker.text()))] if marker else [])
    if last_import is None:
        raise PatchApplicationError(relpath, "module:import", "no top-level import to place the hooks import after")
    planner.idx.index(last_import)
    anchors = [f"module:import@{planner.line(last_import)}", *plan.anchors]
    # every insertion is inside the method: transform it alone, then its class
    new_fn = fn.visit(_Insert(plan.before, plan.after, None, import_stmt))
    assert isinstance(cls.body, cst.IndentedBlock)
    new_cls = cls.with_changes(body=cls.body.with_changes(
        body=tuple(new_fn if s is fn else s for s in cls.body.body)))
    new = _splice(module, source_bytes, planner, cls, new_cls, last_import, import_stmt)
    if new is None:
        if parsed is not source_bytes:
            return None
        new = _regenerate(module, cls, new_cls, last_import, import_stmt)
    inserted = 1 + sum(len(v) for v in plan.before.values()) + sum(len(v) for v in plan.after.values())
    try:
        compile(new, relpath, "exec")
    except SyntaxError as exc:  # a bug here, not in the input: never hand back broken code
        raise PatchApplicationError(relpath, "module", f"rewritten source does not compile: {exc}") from exc
    return RewriteResult(new_bytes=new, anchors=anchors, inserted=inserted)
