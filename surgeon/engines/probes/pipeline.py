"""Pipeline parallelism: which stage captures each fc point, and whether it reaches the draft.

Everything is read from the engine's source, never imported:

* the layer partition is the release's own ``get_pp_indices`` (vLLM ``distributed/utils.py``,
  SGLang ``srt/distributed/utils.py``), evaluated from its parsed body by
  :mod:`surgeon.engines.source.pureeval` with the partition environment variable taken as unset;
* the stage that captures a point is the stage owning the layer whose iteration captures it, from
  the capture sites the probe read (entry of layer ``p``, after layer ``p - 1``, before the loop on
  the first rank, after it on the last), over a loop whose index is read from its header (and any
  ``idx = idx + self.start_layer`` in its body) to be the global layer number; an index that
  restarts at 0 on every stage (``enumerate(islice(self.layers, start, end))``) captures other
  layers on later stages, and is reported as such; a shape not read leaves the answer unverified;
* the evaluated partition is checked to be contiguous ``(start, end)`` pairs covering all layers;
* the draft runs on the last stage. Whether captures of earlier stages reach it is read per release
  and class: vLLM's runner refusing a class without ``supports_aux_hidden_states_over_pp`` at load,
  the flag and the decoder loop's non-last-rank ``IntermediateTensors`` return (carrying the aux
  states or not); SGLang's capture setter returning early on non-last ranks, and server-argument
  checks refusing speculative decoding with ``pp_size > 1``.

Tensor parallelism does not enter the stage placement: ``get_pp_indices`` takes no tp argument
(shown by its signature, cited); what tp does to the captured values is not read here, and the
answer says so.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from surgeon.core.idrules import ClassConvention
from surgeon.core.points import Point
from surgeon.core.spec import Issue, Spec
from surgeon.engines.source.booltest import condition_values, leaves
from surgeon.engines.source.pureeval import NotPure, call_function
from surgeon.engines.source.reading import SOURCE_ERRORS, read_source

_PARTITION_FILE = {"vllm": "distributed/utils.py", "sglang": "srt/distributed/utils.py"}
_TITLES = {"vllm": "vLLM", "sglang": "SGLang"}
_LAYER_BUILDERS = ("make_layers", "make_pp_layers", "get_pp_indices")


class PipelineUnread(ValueError):
    """What the answer needs was not read (the reason names the file and construct)."""


@dataclass(frozen=True)
class Placement:
    point: str
    position: int | None
    stage: int | None  # None: the point is never captured (lint refuses it elsewhere)
    layer: int | None  # the layer whose iteration captures it; None before/after the loop
    reaches: bool | None  # None: not verified
    why: str


@dataclass
class PipelineAnswer:
    engine: str
    release: str
    pp: int
    tp: int
    stages: list[tuple[int, int]]
    partition: str  # file:line of the partition function and what was assumed
    placements: list[Placement] = field(default_factory=list)
    refused: str | None = None  # the engine refuses this draft at this pp (file:line)
    unverified: str | None = None
    notes: list[str] = field(default_factory=list)
    # A stage-local loop index: per point captured wrongly or never, what each stage captures
    # (lint reports these as errors; not part of the JSON shape, the issues carry them).
    misread: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        title = f"{_TITLES.get(self.engine, self.engine)} {self.release}"
        spans = ", ".join(f"{i}: layers {a}..{b - 1}" for i, (a, b) in enumerate(self.stages))
        out = [f"{self.engine}: pp {self.pp}: {title} stages [{spans}] by {self.partition}"]
        if self.refused:
            out.append(f"{self.engine}: pp {self.pp}: {title} refuses this draft at pp > 1: {self.refused}")
        for p in self.placements:
            where = "never captured" if p.stage is None else f"stage {p.stage}" + (
                f" (layer {p.layer}'s iteration)" if p.layer is not None else "")
            fate = {True: "reaches the draft", False: "REFUSED" if self.refused else "DROPPED",
                    None: "unverified"}[p.reaches]
            out.append(f"{self.engine}: pp {self.pp}: {p.point} captured on {where}: {fate}: {p.why}")
        out.extend(f"{self.engine}: {n}" for n in self.notes)
        return out


# -- source reading ------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _parse(path: str, stamp: tuple[int, int] = (0, 0)) -> ast.Module:
    """``stamp`` (mtime, size) keys the cache, so an edited file is read again."""
    return ast.parse(read_source(Path(path)), filename=path)


def _module(root: str, rel: str) -> ast.Module | None:
    path = Path(root) / rel
    if not path.is_file():
        return None
    st = path.stat()
    try:
        return _parse(str(path), (st.st_mtime_ns, st.st_size))
    except SOURCE_ERRORS:  # swapped for a FIFO or grown past the bound since the stat
        return None


def _top(tree: ast.Module, name: str, kind: type) -> ast.AST | None:
    return next((n for n in tree.body if isinstance(n, kind) and getattr(n, "name", None) == name), None)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _env_reads(fn: ast.FunctionDef) -> dict[str, None]:
    """Each read of an environment variable in ``fn`` (``envs.X``, ``os.getenv(...)``,
    ``os.environ.get(...)``), by source text, taken as unset."""
    out: dict[str, None] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "envs":
            out[ast.unparse(node)] = None
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.getenv", "os.environ.get"):
            out[ast.unparse(node)] = None
    return out


def partition(engine: str, root: str, num_layers: int, pp: int) -> tuple[list[tuple[int, int]], str]:
    """The release's stages ``[(start, end), ...]`` for ``num_layers`` over ``pp`` stages, and
    where that was read: its ``get_pp_indices`` evaluated per rank with the override unset."""
    rel = _PARTITION_FILE[engine]
    tree = _module(root, rel)
    fn = _top(tree, "get_pp_indices", ast.FunctionDef) if tree is not None else None
    if not isinstance(fn, ast.FunctionDef):
        raise PipelineUnread(f"{rel}: no get_pp_indices: the layer partition was not read")
    externals = _env_reads(fn)
    try:
        stages = [tuple(call_function(fn, num_layers, rank, pp, externals=externals)) for rank in range(pp)]
    except (NotPure, IndexError, TypeError, ZeroDivisionError) as e:
        raise PipelineUnread(f"{rel}:{fn.lineno}: get_pp_indices not evaluated: {e}") from e
    unset = ", ".join(sorted({k.split("'")[1] if "'" in k else k.split(".")[-1] for k in externals}))
    params = ", ".join(a.arg for a in fn.args.args)
    where = f"{rel}:{fn.lineno} get_pp_indices({params})" + (f" with {unset} unset" if unset else "")
    return check_stages(stages, num_layers, f"{rel}:{fn.lineno} get_pp_indices"), where


def check_stages(stages: list, num_layers: int, source: str) -> list[tuple[int, int]]:
    """``stages`` as ``[(start, end), ...]`` when they are integer pairs, in order, contiguous and
    covering ``[0, num_layers)``; otherwise :class:`PipelineUnread` naming what is wrong."""
    out = []
    for rank, stage in enumerate(stages):
        if len(stage) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in stage):
            raise PipelineUnread(f"{source}: rank {rank} evaluated to {stage!r}, not a (start, end) pair of ints")
        out.append((stage[0], stage[1]))
    bad = next((f"rank {r} is ({a}, {b}): end before start" for r, (a, b) in enumerate(out) if b < a), None)
    if bad is None and out and out[0][0] != 0:
        bad = f"rank 0 starts at layer {out[0][0]}, not 0"
    if bad is None:
        bad = next((f"rank {r + 1} starts at {c}, rank {r} ends at {b}" for r, ((_, b), (c, _d))
                    in enumerate(zip(out, out[1:])) if b != c), None)
    if bad is None and (not out or out[-1][1] != num_layers):
        bad = f"the stages end at {out[-1][1] if out else 'nothing'}, not at the {num_layers} layers"
    if bad is not None:
        raise PipelineUnread(f"{source}: the evaluated partition {out} does not cover layers 0..{num_layers - 1} "
                             f"in order: {bad}")
    return out


# -- stage placement -----------------------------------------------------------------------
def _stage_of(layer: int, stages: list[tuple[int, int]]) -> int:
    found = next((i for i, (a, b) in enumerate(stages) if a <= layer < b), None)
    if found is None:
        raise PipelineUnread(f"layer {layer} is in no stage of the partition {stages}")
    return found


def _site(cc: ClassConvention, position: int, num_layers: int) -> tuple[str, str]:
    """(where: before_loop, loop_entry, loop_exit or after_loop; the site file:line)."""
    site = cc.site_for(position, num_layers)
    where = site.where if site is not None else ("loop_entry" if cc.capture_site == "entry" else "loop_exit")
    cite = f"{site.path}:{site.line} ({where})" if site is not None else f"{cc.path}:{cc.line} ({where}, no site recorded)"
    return where, cite


def place(cc: ClassConvention, position: int | None, num_layers: int,
          stages: list[tuple[int, int]]) -> tuple[int | None, int | None, str]:
    """(stage, layer whose iteration captures it, the site file:line) for capture index ``position``,
    for a loop whose index is the global layer number (see :func:`loop_index`)."""
    if position is None or position not in cc.reachable(num_layers):
        return None, None, "no capture site reaches it"
    where, cite = _site(cc, position, num_layers)
    if where == "before_loop":
        return 0, None, cite
    if where == "after_loop":
        return len(stages) - 1, None, cite
    layer = position if where == "loop_entry" else position - 1
    return _stage_of(layer, stages), layer, cite


# -- the loop's index: global layer number, or counted from 0 on every stage -----------------
_START = "self.start_layer"


def _point_name(position: int) -> str:
    return "embed" if position == 0 else f"layer_out[{position - 1}]"


def _enclosing(tree: ast.Module, node: ast.AST) -> ast.FunctionDef | None:
    line = getattr(node, "lineno", 0)
    fns = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.lineno <= line <= (f.end_lineno or 0)]
    return max(fns, key=lambda f: f.lineno, default=None)


def _is_start(expr: ast.expr | None, fn: ast.FunctionDef | None, before: int) -> str | None:
    """How ``expr`` is the stage's first global layer (``self.start_layer``, or a local name whose
    first assignment before line ``before`` is), or None."""
    if expr is None:
        return None
    if ast.unparse(expr) == _START:
        return _START
    if not isinstance(expr, ast.Name) or fn is None:
        return None
    assigns = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Assign) and n.lineno < before
                      and any(isinstance(t, ast.Name) and t.id == expr.id for t in n.targets)), key=lambda n: n.lineno)
    if not assigns or ast.unparse(assigns[0].value) != _START:
        return None
    later = [f"{n.lineno}" for n in assigns[1:]]
    return f"{expr.id} = {_START} at line {assigns[0].lineno}" + (
        f" (reassigned at line {', '.join(later)}: not followed)" if later else "")


def _slice_start(expr: ast.expr) -> ast.expr | None:
    """The start of ``islice(X, start, end)`` or ``X[start:end]``; None when ``expr`` is neither."""
    if isinstance(expr, ast.Call) and ast.unparse(expr.func).split(".")[-1] == "islice" and len(expr.args) == 3:
        return expr.args[1]
    if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Slice):
        return expr.slice.lower
    return None


def _rebinding(loop: ast.For, name: str, fn: ast.FunctionDef | None) -> tuple[bool, str] | None:
    """How the body rebinds the loop index ``name``: None when it does not; (True, how) for one
    ``name = name + <stage start>`` (or ``+=``) before any other use; (False, how) otherwise."""
    binds = [n for s in loop.body for n in ast.walk(s) if (isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == name for t in n.targets)) or (isinstance(n, ast.AugAssign | ast.AnnAssign)
        and isinstance(n.target, ast.Name) and n.target.id == name)]
    if not binds:
        return None
    first = next((s for s in loop.body if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(s))), None)
    value = first.value if isinstance(first, ast.Assign | ast.AugAssign) else None
    if len(binds) == 1 and binds[0] is first and value is not None:
        if isinstance(first, ast.AugAssign) and isinstance(first.op, ast.Add):
            shift = _is_start(value, fn, loop.lineno)
        elif isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
            pair = (value.left, value.right)
            other = next((e for e in pair if not (isinstance(e, ast.Name) and e.id == name)), None)
            shift = _is_start(other, fn, loop.lineno) if len([e for e in pair if e is other]) == 1 else None
        else:
            shift = None
        if shift:
            return True, f"line {first.lineno} adds {shift} to {name}"
    return False, f"{name} is rebound at line {binds[0].lineno} (`{ast.unparse(binds[0])}`), not read"


def _index_kind(loop: ast.For, fn: ast.FunctionDef | None) -> tuple[str | None, str]:
    """("global" | "local" | None when the shape is not recognised, how it was read), the
    body's rebinding of the index (``idx = idx + self.start_layer``) taken into account."""
    index = loop.target.elts[0] if isinstance(loop.target, ast.Tuple) and loop.target.elts else loop.target
    kind, how = _header_kind(loop, fn)
    rebound = _rebinding(loop, index.id, fn) if isinstance(index, ast.Name) and kind is not None else None
    if rebound is None:
        return kind, how + (": stage-local, it restarts at 0 on every stage" if kind == "local" else "")
    if not rebound[0]:
        return None, f"{how}, but {rebound[1]}"
    if kind == "local":
        return "global", f"{how}, and {rebound[1]}: global"
    return None, f"{how}, and {rebound[1]} as well"


def _header_kind(loop: ast.For, fn: ast.FunctionDef | None) -> tuple[str | None, str]:
    """What the loop header alone makes of its index (see :func:`_index_kind`)."""
    it, target = loop.iter, loop.target
    func = ast.unparse(it.func).split(".")[-1] if isinstance(it, ast.Call) else ""
    index = target.elts[0] if isinstance(target, ast.Tuple) and len(target.elts) == 2 else target
    if not isinstance(index, ast.Name):
        return None, "its target has no plain index name"
    if not any(isinstance(n, ast.Name) and n.id == index.id for s in loop.body for n in ast.walk(s)):
        return None, f"its body does not read {index.id}"
    if func == "range" and isinstance(it, ast.Call) and len(it.args) == 1 and isinstance(target, ast.Name) \
            and isinstance(it.args[0], ast.Call) and ast.unparse(it.args[0].func) == "len" \
            and len(it.args[0].args) == 1 and isinstance(it.args[0].args[0], ast.Attribute):
        return "global", f"it counts over all of {ast.unparse(it.args[0].args[0])} from 0"
    if func == "range" and isinstance(it, ast.Call) and len(it.args) == 2 and isinstance(target, ast.Name):
        how = _is_start(it.args[0], fn, loop.lineno)
        return ("global", f"range starts at {how}") if how else (None, "its range does not start at the stage's first layer")
    if func == "islice" and isinstance(it, ast.Call) and it.args and isinstance(it.args[0], ast.Call) \
            and ast.unparse(it.args[0].func) == "enumerate" and len(it.args[0].args) == 1 \
            and not it.args[0].keywords and _slice_start(it.args[0].args[0]) is None:
        return "global", "it slices enumerate() of all the layers"
    if func != "enumerate" or not isinstance(it, ast.Call) or not it.args or isinstance(target, ast.Name):
        return None, "its shape is not one the check reads (enumerate, islice(enumerate(...)) or range)"
    start = it.args[1] if len(it.args) > 1 else next((k.value for k in it.keywords if k.arg == "start"), None)
    sliced = _slice_start(it.args[0])
    if sliced is None:
        if start is None and isinstance(it.args[0], ast.Attribute):
            return "global", f"it enumerates all of {ast.unparse(it.args[0])} from 0"
        return None, "it enumerates something other than a slice of the layers"
    from_stage = _is_start(sliced, fn, loop.lineno)
    if from_stage is None:
        return None, "its slice does not start at the stage's first layer"
    if start is None:
        return "local", f"{index.id} counts from 0 over the slice starting at {from_stage}"
    how = _is_start(start, fn, loop.lineno)
    return ("global", f"enumerate starts at {how}") if how else (None, f"enumerate starts at {ast.unparse(start)}")


def loop_index(root: str, cc: ClassConvention) -> tuple[str | None, str]:
    """Whether the decoder loop's index, tested against the capture ids, is the global layer
    number ("global") or restarts at 0 on every stage ("local"), read from the loop the probe
    recorded; None when not recognised. The text cites the loop's file:line and header."""
    loops = cc.evidence_of("loop")
    if not loops:
        return None, f"{cc.loop_owner or cc.path}: the decoder loop's line was not recorded"
    ev = loops[0]
    tree = _module(root, ev.path)
    loop = next((n for n in ast.walk(tree) if isinstance(n, ast.For) and n.lineno == ev.line), None) if tree else None
    if tree is None or loop is None:
        return None, f"{ev.path}:{ev.line}: no for loop read there"
    target = loop.target
    names = ", ".join(map(ast.unparse, target.elts)) if isinstance(target, ast.Tuple) else ast.unparse(target)
    header = f"for {names} in {ast.unparse(loop.iter)}"
    kind, how = _index_kind(loop, _enclosing(tree, loop))
    index = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target
    if isinstance(index, ast.Name):
        kind, how = _what_sites_read(cc, ev.path, loop, index.id, kind, how)
    return kind, f"{ev.path}:{ev.line} `{header}`: {how}"


def _layer_names(loop: ast.For, index: str) -> set[str]:
    """Names bound to the layer object: the loop's second target, or ``x = self.layers[index]``."""
    names = {loop.target.elts[1].id} if isinstance(loop.target, ast.Tuple) and len(loop.target.elts) == 2 \
        and isinstance(loop.target.elts[1], ast.Name) else set()
    for node in (n for s in loop.body for n in ast.walk(s)):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and ast.unparse(node.value) == f"self.layers[{index}]":
            names.add(node.targets[0].id)
    return names


def _what_sites_read(cc: ClassConvention, path: str, loop: ast.For, index: str, kind: str | None,
                     how: str) -> tuple[str | None, str]:
    """(kind, how) once the capture sites recorded inside ``loop`` are read: a site testing the
    loop index keeps the header's answer; one testing the layer object's own attribute (a flag the
    setter set on that layer) does not rest on the index; any other is not read."""
    stmts = [n for s in loop.body for n in ast.walk(s) if isinstance(n, ast.stmt)]
    layers = _layer_names(loop, index)
    for site in cc.sites:
        if site.path != path or site.where not in ("loop_entry", "loop_exit") \
                or not loop.lineno < site.line <= (loop.end_lineno or 0):
            continue
        around = [n for n in stmts if n.lineno <= site.line <= (n.end_lineno or n.lineno)]
        stmt = min(around, key=lambda n: (n.end_lineno or n.lineno) - n.lineno, default=None)
        if stmt is None or any(isinstance(n, ast.Name) and n.id == index for n in ast.walk(stmt)):
            continue
        if any((isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in layers)
               or (isinstance(n, ast.Call) and ast.unparse(n.func) == "getattr" and n.args
                   and isinstance(n.args[0], ast.Name) and n.args[0].id in layers) for n in ast.walk(stmt)):
            return "global", (f"the capture at {site.path}:{site.line} tests an attribute of the layer object, "
                              f"not {index}: set per layer, it does not rest on the loop index")
        return None, f"{how}, but the capture at {site.path}:{site.line} does not read {index}"
    return kind, how


def _local_placement(cc: ClassConvention, position: int | None, num_layers: int, stages: list[tuple[int, int]],
                     loop: str) -> tuple[int | None, int | None, str, str | None]:
    """For a stage-local loop index: (stage capturing ``position`` itself, its layer, why, the error
    when a stage captures another state in its place or none captures it)."""
    if position is None or position not in cc.reachable(num_layers):
        return None, None, "no capture site reaches it", None
    where, cite = _site(cc, position, num_layers)
    if where in ("before_loop", "after_loop"):
        stage = 0 if where == "before_loop" else len(stages) - 1
        return stage, None, cite, None
    local = position if where == "loop_entry" else position - 1
    said, right, wrong = [], None, False
    for s, (a, b) in enumerate(stages):
        if not 0 <= local < b - a:
            said.append(f"stage {s} (layers {a}..{b - 1}) counts 0..{b - a - 1}, never {position}")
        elif a == 0:
            right = s
            said.append(f"stage {s} (layers {a}..{b - 1}) captures {_point_name(position)}")
        else:
            wrong = True
            said.append(f"stage {s} (layers {a}..{b - 1}) captures {_point_name(a + position)} in its place")
    what = "; ".join(said)
    why = f"{cite}; {loop}: {what}"
    error = None
    if wrong or right is None:
        fault = "a later stage matches its index on another layer" if right is not None else "no stage captures it"
        error = f"{_point_name(position)} (capture index {position}): {fault}: {loop}: {what}"
    return right, (local if right is not None else None), why, error


def _mentions_first_rank(test: ast.expr) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "is_first_rank" for n in ast.walk(test))


def _first_rank_test(test: ast.expr) -> tuple[set[bool], set[bool]] | None:
    """The values ``test`` can take on the first rank and on a later one (``is_first_rank`` under
    ``not``/``and``/``or``, every other condition free); None where ``is_first_rank`` appears in
    another form (a comparison, a call's argument) this does not read."""
    def rank(n: ast.expr) -> bool:
        return isinstance(n, ast.Attribute) and n.attr == "is_first_rank"

    if any(_mentions_first_rank(n) and not rank(n) for n in leaves(test)):
        return None
    first = condition_values(test, lambda n: True if rank(n) else None)
    later = condition_values(test, lambda n: False if rank(n) else None)
    return None if first is None or later is None else (first, later)


def _rank_guard(tree: ast.Module, line: int, rel: str) -> tuple[str, str] | None:
    """Which ranks run ``line`` by the ``is_first_rank`` tests around it: ("first" | "later" |
    "unread", file:line of the test), the innermost deciding test first; None: under no such test."""
    found: list[tuple[int, str, str]] = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.If) and _mentions_first_rank(n.test)):
            continue
        for branch, taken in ((n.body, True), (n.orelse, False)):
            if not any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in branch):
                continue
            values = _first_rank_test(n.test)
            if values is None or (taken in values[0]) == (taken in values[1]):
                kind = "unread"  # both ranks (another condition decides) or the test was not read
            else:
                kind = "first" if taken in values[0] else "later"
            found.append((n.lineno, kind, f"{rel}:{n.lineno}"))
    if not found:
        return None
    kinds = {k for _, k, _ in found}
    kind = kinds.pop() if len(kinds) == 1 else "unread"
    return kind, max(found)[2]


def _received(fn: ast.FunctionDef, rel: str) -> str | None:
    """file:line where a later stage's ``hidden_states`` comes from ``intermediate_tensors`` (the
    branch of the forward's ``is_first_rank`` test that later ranks take), or None where that was
    not read."""
    for n in ast.walk(fn):
        values = _first_rank_test(n.test) if isinstance(n, ast.If) and _mentions_first_rank(n.test) else None
        if values is None or not isinstance(n, ast.If):
            continue
        later = n.body if values[1] == {True} and values[0] == {False} else \
            n.orelse if values[1] == {False} and values[0] == {True} else []
        for a in (m for s in later for m in ast.walk(s)):
            if isinstance(a, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "hidden_states" for t in a.targets) \
                    and "intermediate_tensors" in ast.unparse(a.value):
                return f"{rel}:{a.lineno}"
    return None


def before_loop_capture(root: str, cc: ClassConvention, position: int | None,
                        num_layers: int) -> tuple[str, str, str | None] | None:
    """For a capture made before the decoder loop that is not first-rank-only: (which ranks make it:
    "every" | "later" | "unread", its site, where later stages' ``hidden_states`` come from). vLLM
    0.32's qwen3_vl and gemma4 call ``_maybe_add_hidden_state([], 0, ...)`` unconditionally
    ("every"), llama only ``if get_pp_group().is_first_rank`` (None); a site under ``if not
    ...is_first_rank`` or in that test's ``else`` runs on the later ranks only ("later"); a test
    whose branch is not decided by the rank alone is "unread"."""
    site = cc.site_for(position, num_layers) if position is not None else None
    if site is None or site.where != "before_loop":
        return None
    tree = _module(root, site.path)
    if tree is None:
        return None
    guard = _rank_guard(tree, site.line, site.path)
    if guard is not None and guard[0] == "first":
        return None
    fn = _enclosing(tree, ast.Pass(lineno=site.line, col_offset=0))
    where = f"{site.path}:{site.line}" + (f" (under the is_first_rank test at {guard[1]})" if guard else "")
    return guard[0] if guard else "every", where, (_received(fn, site.path) if fn is not None else None)


def every_rank_capture(root: str, cc: ClassConvention, position: int | None,
                       num_layers: int) -> tuple[str, str | None] | None:
    """(its site, where later stages' ``hidden_states`` come from) for a capture before the decoder
    loop that every rank makes (under no ``is_first_rank`` test); None otherwise."""
    got = before_loop_capture(root, cc, position, num_layers)
    return (got[1], got[2]) if got is not None and got[0] == "every" else None


def _before_loop_placement(point: str, position: int, stages: list[tuple[int, int]], ranks: str, site: str,
                           received: str | None, forwarded: tuple[bool | None, str],
                           ) -> tuple[Placement, str | None, str | None]:
    """(the placement, the error, unverified) for a before-loop capture that is not first-rank-only.
    Every rank: stage 0 captures the point itself; every later stage captures, at the same index,
    the state it received, which is the previous stage's output (``hidden_states + residual``), and
    the draft's stage hands the draft that in the point's place. Later ranks only: the same, less
    stage 0. ``forwarded``: whether, and why, a capture of stage 0 reaches the draft's stage."""
    last = len(stages) - 1
    earlier, how = forwarded
    if ranks == "unread":
        return (Placement(point, position, 0, None, None, f"{site} (before_loop); {how}"), None,
                f"{site}: which pipeline ranks make the capture before the loop was not read")
    tag = "every rank" if ranks == "every" else "later ranks only"
    stage, reaches, tail = (0, earlier, f"; {how}") if ranks == "every" else (last, True, ": the draft's stage")
    if received is None:
        return (Placement(point, position, stage, None, reaches if ranks == "every" else None,
                          f"{site} (before_loop, {tag}){tail}"),
                None, f"{site}: the capture before the loop runs on {tag}, and what a later stage holds there "
                "was not read")
    a0, b0 = stages[0]
    said = [f"stage 0 (layers {a0}..{b0 - 1}) " + (f"captures {_point_name(position)}" if ranks == "every" else
                                                   "does not make it (the first rank skips the site)")]
    said += [f"stage {s} (layers {a}..{b - 1}) captures layer_out[{a - 1}] in its place (its hidden_states come "
             f"from intermediate_tensors at {received})" for s, (a, b) in enumerate(stages) if s]
    what = "; ".join(said)
    why = f"{site} (before_loop, {tag}" + (", not under is_first_rank" if ranks == "every" else "") + f"): {what}"
    error = f"{_point_name(position)} (capture index {position}): the draft's stage captures another state: {why}"
    return Placement(point, position, stage, None, reaches, why + tail), error, None


def _builds_layers(root: str, owner: str, package: str) -> str | None:
    """file:line where the loop owner's class (or a base) builds its layers through the partition
    with the pipeline rank (``make_layers`` given no rank builds every layer), or None."""
    path, _, qual = owner.partition(":")
    try:
        chain = list(_class_chain(root, path, qual.split(".")[0], package))
    except PipelineUnread:
        return None
    for rel, cls in chain:
        for node in ast.walk(cls):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in _LAYER_BUILDERS:
                name = ast.unparse(node.func).split(".")[-1]
                if package == "sglang" and name == "make_layers" and len(node.args) < 3 \
                        and not any(k.arg == "pp_rank" for k in node.keywords):
                    continue
                return f"{rel}:{node.lineno} {ast.unparse(node.func)}(...)"
    return None


# -- forwarding: vLLM ----------------------------------------------------------------------
_FLAG = "supports_aux_hidden_states_over_pp"
_VLLM_GUARD = ("v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", "verify_supports_aux_hidden_states_over_pp",
               "v1/worker/gpu/model_runner.py")


def _imports(tree: ast.Module, package: str, rel: str) -> dict[str, str]:
    """Names imported from the engine's own package (absolute, or relative to ``rel``) -> the
    file (relative to its root)."""
    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            parts = rel.split("/")[:-node.level] + (node.module.split(".") if node.module else [])
        elif node.module and node.module.startswith(package + "."):
            parts = node.module.removeprefix(package + ".").split(".")
        else:
            continue
        out.update({a.asname or a.name: "/".join(parts) + ".py" for a in node.names})
    return out


def _class_flag(cls: ast.ClassDef) -> ast.Assign | ast.AnnAssign | None:
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target: ast.expr | None = stmt.targets[0]
        elif isinstance(stmt, ast.AnnAssign):
            target = stmt.target
        else:
            continue
        if isinstance(target, ast.Name) and target.id == _FLAG:
            return stmt
    return None


def _class_chain(root: str, rel: str, name: str, package: str) -> Iterator[tuple[str, ast.ClassDef]]:
    """(file, class) for ``name`` and its bases, nearest first, followed through the engine's own
    imports; a base the engine defines but that was not found raises :class:`PipelineUnread`."""
    queue, seen = [(rel, name)], set()
    while queue:
        rel, name = queue.pop(0)
        if (rel, name) in seen:
            continue
        seen.add((rel, name))
        tree = _module(root, rel)
        cls = _top(tree, name, ast.ClassDef) if tree is not None else None
        if tree is None or not isinstance(cls, ast.ClassDef):
            raise PipelineUnread(f"{rel}: class {name} not found")
        yield rel, cls
        imported = _imports(tree, package, rel)
        for base in cls.bases:
            bname = ast.unparse(base)
            if _top(tree, bname, ast.ClassDef) is not None:
                queue.append((rel, bname))
            elif bname in imported:
                queue.append((imported[bname], bname))


def vllm_flag(root: str, owner: str) -> tuple[bool, str]:
    """(value, file:line) of ``supports_aux_hidden_states_over_pp`` on the loop owner's class or
    the nearest base that sets it (followed through the engine's own imports)."""
    path, _, qual = owner.partition(":")
    files = []
    for rel, cls in _class_chain(root, path, qual.split(".")[0], "vllm"):
        files.append(rel)
        stmt = _class_flag(cls)
        if stmt is not None:
            value = stmt.value
            if not isinstance(value, ast.Constant) or not isinstance(value.value, bool):
                raise PipelineUnread(f"{rel}:{stmt.lineno}: {cls.name}.{_FLAG} is not a constant")
            return value.value, f"{rel}:{stmt.lineno} {cls.name}.{_FLAG} = {value.value}"
    return False, f"{path}: {qual.split('.')[0]} and its bases in {', '.join(sorted(set(files)))} do not set {_FLAG}"


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] == name]


def _vllm_guard(root: str) -> str | None:
    """file:line of the runner refusing a class without the flag when pp > 1, or None: the check
    called from the runner directly or through one function of its own file."""
    rel, name, runner = _VLLM_GUARD
    tree, rtree = _module(root, rel), _module(root, runner)
    fn = _top(tree, name, ast.FunctionDef) if tree is not None else None
    if not isinstance(fn, ast.FunctionDef) or rtree is None or tree is None:
        return None
    raises = [n for n in ast.walk(fn) if isinstance(n, ast.Raise)]
    if not raises:
        return None
    said = f"{rel}:{raises[0].lineno} {name} raises ValueError"
    direct = _calls(rtree, name)
    if direct:
        return f"{said}, called by {runner}:{direct[0].lineno} when pp > 1"
    for outer in tree.body:
        if isinstance(outer, ast.FunctionDef) and _calls(outer, name) and _calls(rtree, outer.name):
            return (f"{said}, called at {rel}:{_calls(outer, name)[0].lineno} in {outer.name}, which "
                    f"{runner}:{_calls(rtree, outer.name)[0].lineno} calls")
    return None


def _vllm_v1_setup(root: str) -> str:
    """What the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``, or a feature V2 lacks) does, as
    far as read: the line that sets up the drafter and aux capture only on the last rank."""
    rel = "v1/worker/gpu_model_runner.py"
    tree = _module(root, rel)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.If) and "speculative_config" in ast.unparse(node.test) \
                and "is_last_rank" in ast.unparse(node.test):
            return (f"the V1 runner ({rel}:{node.lineno}) sets up the drafter and aux capture only "
                    f"`if {ast.unparse(node.test)}`; what its earlier ranks then capture was not followed")
    return f"the V1 runner ({rel}) was not read"


def _loop_return(root: str, owner: str) -> tuple[bool, str] | None:
    """(carries aux states, file:line) of the loop method's ``return IntermediateTensors(...)``."""
    path, _, qual = owner.partition(":")
    cname, _, mname = qual.partition(".")
    tree = _module(root, path)
    cls = _top(tree, cname, ast.ClassDef) if tree is not None else None
    fn = _method(cls, mname) if isinstance(cls, ast.ClassDef) else None
    if fn is None:
        return None
    for node in ast.walk(fn):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call) \
                and ast.unparse(node.value.func).endswith("IntermediateTensors"):
            carries = "aux" in ast.unparse(node.value)
            what = "packs the aux states into it" if carries else "carries no aux states"
            return carries, f"{path}:{node.lineno} the non-last-stage return IntermediateTensors(...) {what}"
    return None


def _collects(root: str, owner: str) -> bool:
    """The loop method reads the aux states of earlier stages (``collect_remote_aux_hidden_states``)."""
    found = _function(root, owner.rpartition(".")[0], owner.rpartition(".")[2])
    return found is not None and bool(_calls(found[1], "collect_remote_aux_hidden_states"))


def _vllm_forwarding(root: str, cc: ClassConvention) -> tuple[bool | None, str, str | None, list[str]]:
    """(earlier-stage captures reach the draft, why, refused, notes)."""
    if cc.loop_owner is None:
        return None, "the decoder loop's owner was not read", None, []
    flag, flag_at = vllm_flag(root, cc.loop_owner)
    guard = _vllm_guard(root)
    ret = _loop_return(root, cc.loop_owner)
    notes = [f"pp: the answer is the V2 model runner's; {_vllm_v1_setup(root)}"] if guard else []
    if guard and not flag:
        return False, flag_at, f"{flag_at}; {guard}", notes
    if flag and ret is not None and ret[0]:
        return True, f"forwarded: {flag_at}; {ret[1]}", None, notes
    if not guard and ret is not None and not ret[0]:
        return False, f"{ret[1]}, and no runner check refuses it", None, notes
    if flag and ret is not None and not ret[0] and not _collects(root, cc.loop_owner):
        return False, (f"{flag_at} passes the runner's check, but {ret[1]} and {cc.loop_owner} never calls "
                       "collect_remote_aux_hidden_states"), None, notes
    return None, f"{flag_at}; {ret[1] if ret else 'the non-last-stage return was not read'}", None, notes


# -- forwarding: SGLang --------------------------------------------------------------------
def _sglang_refusal(root: str) -> str | None:
    """file:line where server arguments refuse speculative decoding with pp_size > 1, or None."""
    rel = "srt/server_args.py"
    tree = _module(root, rel)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "pp_size > 1" in ast.unparse(node.test):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Assert) and "speculative_algorithm is None" in ast.unparse(inner.test):
                    return f"{rel}:{inner.lineno}: with pp_size > 1 it asserts speculative_algorithm is None"
    return None


def _sglang_early_return(root: str, cc: ClassConvention) -> str | None:
    """file:line where the capture setter returns before storing any id unless on the last rank."""
    if cc.setter is None or cc.setter_owner is None:
        return None
    path, _, cname = cc.setter_owner.partition(":")
    tree = _module(root, path)
    cls = _top(tree, cname, ast.ClassDef) if tree is not None else None
    fn = _method(cls, cc.setter) if isinstance(cls, ast.ClassDef) else None
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))] if fn else []
    first = body[0] if body else None
    if isinstance(first, ast.If) and isinstance(first.test, ast.UnaryOp) and isinstance(first.test.op, ast.Not) \
            and ast.unparse(first.test.operand).endswith("is_last_rank") \
            and len(first.body) == 1 and isinstance(first.body[0], ast.Return) and first.body[0].value is None:
        return f"{path}:{first.lineno} {cname}.{cc.setter} returns at once `if {ast.unparse(first.test)}`"
    return None


def _sglang_forwarding(root: str, cc: ClassConvention) -> tuple[bool | None, str, str | None, list[str]]:
    refused = _sglang_refusal(root)
    early = _sglang_early_return(root, cc)
    if early is not None:
        return False, f"{early}: earlier stages capture nothing (each stage's loop runs only its own layers)", \
            refused, []
    return None, f"{cc.setter_owner}.{cc.setter} was not read to a pp rule", refused, []


# -- tensor parallelism --------------------------------------------------------------------
_TP_WORDS = ("tp_rank", "tp_size", "tp_group", "tensor_model_parallel", "attn_tp", "dp_attention")


def _function(root: str, owner: str, name: str) -> tuple[str, ast.FunctionDef] | None:
    path, _, cname = owner.partition(":")
    tree = _module(root, path)
    cls = _top(tree, cname.split(".")[0], ast.ClassDef) if tree is not None else None
    fn = _method(cls, name) if isinstance(cls, ast.ClassDef) else None
    return (path, fn) if fn is not None else None


def tp_note(root: str, cc: ClassConvention, tp: int) -> tuple[str, str | None]:
    """(note, unverified): whether the capture setter or the decoder loop read the tensor-parallel
    rank or size (then which states are captured could depend on tp: not modelled)."""
    parts = []
    if cc.setter and cc.setter_owner:
        parts.append(_function(root, cc.setter_owner, cc.setter))
    if cc.loop_owner:
        parts.append(_function(root, cc.loop_owner.rpartition(".")[0], cc.loop_owner.rpartition(".")[2]))
    if not parts or any(p is None for p in parts):
        return f"tp {tp}: the capture setter or the decoder loop was not read for tp", "tp not read" if tp > 1 else None
    reads, cites = [], []
    for path, fn in (p for p in parts if p is not None):
        cites.append(f"{path}:{fn.lineno} {fn.name}")
        reads += [f"{path}:{n.lineno} {ast.unparse(n)}" for n in ast.walk(fn) if isinstance(n, ast.Name | ast.Attribute)
                  and any(w in (n.id if isinstance(n, ast.Name) else n.attr) for w in _TP_WORDS)]
    if reads:
        return (f"tp {tp}: the capture code reads tensor-parallel state ({'; '.join(dict.fromkeys(reads))}): "
                "not modelled", "the capture code reads tensor-parallel state" if tp > 1 else None)
    return (f"tp {tp}: {' and '.join(cites)} read no tensor-parallel rank or size, so which indices are captured "
            "does not depend on tp there (helpers they call were not scanned); the stage placement neither "
            "(get_pp_indices takes no tp); whether a captured value is the full hidden state under tp was not read"), None


# -- the answer ----------------------------------------------------------------------------
def pipeline_answer(engine: str, root: str, release: str, cc: ClassConvention, points: list[Point],
                    num_layers: int, pp: int, tp: int = 1) -> PipelineAnswer:
    """Per fc point: the stage capturing it (over the release's partition) and whether it reaches
    the draft on the last stage. Raises :class:`PipelineUnread` when the partition was not read."""
    if pp < 1 or tp < 1:
        raise PipelineUnread(f"pp and tp must be >= 1 (got pp {pp}, tp {tp})")
    if pp > num_layers:
        raise PipelineUnread(f"pp {pp} exceeds the target's {num_layers} layers")
    stages, where = partition(engine, root, num_layers, pp)
    ans = PipelineAnswer(engine, release, pp, tp, stages, where)
    built = _builds_layers(root, cc.loop_owner, engine) if cc.loop_owner else None
    if built is None:
        ans.unverified = f"{cc.loop_owner or cc.path}: the loop owner's layers were not read to come from get_pp_indices"
    forward = (_vllm_forwarding if engine == "vllm" else _sglang_forwarding)(root, cc) if pp > 1 else (True, "", None, [])
    earlier, why, ans.refused, ans.notes = forward
    kind, loop = loop_index(root, cc) if pp > 1 else ("global", "")
    if kind is None:
        ans.unverified = "; ".join(filter(None, [ans.unverified, f"whether the decoder loop's index is the global "
                                                 f"layer number was not read: {loop}"]))
    for p in points:
        every = before_loop_capture(root, cc, p.position, num_layers) if pp > 1 and p.position is not None else None
        if every is not None and p.position is not None:
            placed, error, unread = _before_loop_placement(str(p), p.position, stages, *every, (earlier, why))
            ans.misread.extend([error] if error else [])
            ans.unverified = "; ".join(filter(None, [ans.unverified, unread])) or None
            ans.placements.append(placed)
            continue
        if kind == "local":
            stage, layer, site, error = _local_placement(cc, p.position, num_layers, stages, loop)
            ans.misread.extend([error] if error else [])
        else:
            stage, layer, site = place(cc, p.position, num_layers, stages)
        sure = kind is not None or layer is None  # a loop-site capture rests on the loop's index
        if stage is None:
            ans.placements.append(Placement(str(p), p.position, None, None, False, site))
        elif stage == pp - 1:
            ans.placements.append(Placement(str(p), p.position, stage, layer, True if sure else None,
                                            f"{site}: the draft's stage"))
        else:
            ans.placements.append(Placement(str(p), p.position, stage, layer, earlier if sure else None,
                                            f"{site}; {why}"))
    if pp > 1:
        ans.notes.append(f"pp: decoder loop {loop}")
    if built is not None:
        ans.notes.append(f"pp: layers built by {built}")
    note, tp_unverified = tp_note(root, cc, tp)
    ans.notes.append(note)
    if tp_unverified and not ans.unverified:
        ans.unverified = tp_unverified
    return ans


def lint_pipeline(spec: Spec, engine: str, root: str, release: str, cc: ClassConvention, pp: int, tp: int,
                  *, strict: bool) -> tuple[list[Issue], list[str], PipelineAnswer | None]:
    """``surgeon lint --pp``: (issues at the spec's fc_input, checked lines, the answer: ``lint --json``
    prints it through its output model, ``misread`` left to the issues).
    A capture that does not reach the draft, or an engine refusing the draft at this pp, is an
    error; an answer resting on code not read is a warning (an error when ``strict``)."""
    fc = ("draft", "fc_input")
    unverified = "error" if strict else "warning"
    try:
        ans = pipeline_answer(engine, root, release, cc, spec.fc_points, spec.num_layers, pp, tp)
    except PipelineUnread as e:
        return [spec.issue(fc, f"{engine}: pp {pp}: unverified: {e}", severity=unverified)], [], None
    issues = []
    title = f"{_TITLES.get(engine, engine)} {release}"
    if ans.refused:
        issues.append(spec.issue(fc, f"{engine}: pp {pp}: {title} refuses this draft with pipeline parallelism: "
                                     f"{ans.refused}"))
    if ans.unverified:
        issues.append(spec.issue(fc, f"{engine}: pp {pp}: unverified: {ans.unverified}", severity=unverified))
    issues.extend(spec.issue(fc, f"{engine}: pp {pp}: {m}") for m in ans.misread)
    last = pp - 1
    for p in ans.placements:
        if p.stage is None or p.stage == last:
            continue  # never captured: refused by the capture check itself
        if p.reaches is False and not ans.refused:
            issues.append(spec.issue(fc, f"{engine}: pp {pp}: {p.point} is captured on stage {p.stage} and never "
                                         f"reaches the draft on stage {last}: {p.why}"))
        elif p.reaches is None:
            issues.append(spec.issue(fc, f"{engine}: pp {pp}: unverified: whether {p.point} (stage {p.stage}) "
                                         f"reaches the draft on stage {last}: {p.why}", severity=unverified))
    return issues, ans.lines(), ans
