"""Patch coverage of an installed engine: which decoder-layer loops the rewriter can patch.

:func:`coverage` visits every model file of an engine (located with
:mod:`surgeon.engines.source.locate`, never imported). A class *owns a decoder-layer loop* when its
recipe's method (``forward``) holds a ``for`` loop over ``self.<layers_attr>`` (``self.layers``)
or a ``range`` loop that indexes it; for each such class it reports whether the rewriter can
insert the layer captures (``layer_out[k]``), the embedding capture and the final-norm capture,
the rewriter's reason when not, and whether the engine captures natively (the engine probe's
classified classes whose ``loop_owner`` is this class's method).

Speed: the stdlib ``ast`` parser (fast) decides which files hold a loop-owning class at all
(:func:`loop_owners_ast`); only those are parsed with libcst, in a process pool, and each file
once (the rewriter's plan is checked on the parsed module, no code is generated).

A class is a *decoder* when the loop method takes the engine's token-level inputs
(``positions``, ``position_ids``, ``input_ids``, ``forward_batch`` or ``intermediate_tensors``);
the others are encoder towers (vision, audio) fed with features, whose layers are not the
residual stream a draft reads. Both are reported; :attr:`EngineCoverage.fraction` is over
decoder classes, :attr:`EngineCoverage.fraction_all` over all of them.

A class refused only because its method runs decoder layers outside the capture loop (SGLang's
two-batch-overlap ``model_forward_stages``) is reported as patchable *with the bypass guard*
(:attr:`ClassCoverage.with_guard`, what ``surgeon apply --guard-bypass`` does: a runtime check that
raises when that path would run a captured layer); :attr:`EngineCoverage.fraction_guarded` counts
those too, :attr:`EngineCoverage.fraction` does not.
"""

from __future__ import annotations

import ast
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from surgeon.core.errors import BadInput, unreadable
from surgeon.core.safefile import UnsafeFile
from surgeon.core.safefile import read_bytes as safe_read_bytes
from surgeon.core.shapes import Reads
from surgeon.engines.source.anatomy import ast_span, loops_over_ast
from surgeon.engines.source.locate import ProbeError, layout_of, locate_engine
from surgeon.engines.source.reading import SOURCE_LIMIT
from surgeon.patch.planner import Checker
from surgeon.patch.recipes import (
    PatchApplicationError,
    find_recipe,
    load_recipes,
    parse,
    parse_reduced,
)

__all__ = [
    "PROBE_POSITIONS",
    "ClassCounts",
    "ClassCoverage",
    "CoverageReport",
    "EngineCoverage",
    "NonDecoderClasses",
    "Unparsed",
    "coverage",
    "loop_owners_ast",
    "render_coverage_lines",
    "render_coverage_table",
]

PROBE_POSITIONS = frozenset({1, 2})  # layer_out[0], layer_out[1]; the embedding (0) is tried apart
_DECODER_PARAMS = frozenset({"positions", "position_ids", "input_ids", "forward_batch", "intermediate_tensors"})


@dataclass(frozen=True)
class ClassCoverage:
    path: str  # relative to the engine package, e.g. "srt/models/llama.py"
    class_name: str
    method: str
    line: int
    decoder: bool
    layers: bool  # layer_out[k] captures can be inserted: the class is patchable
    embed: bool  # the capture before the loop too
    final_norm: bool
    reason: str | None = None  # why the layers are not patchable
    embed_reason: str | None = None
    final_norm_reason: str | None = None
    recipe: str | None = None  # the patches/*.yaml recipe used, None: generic
    native: tuple[str, ...] = ()  # classes the engine's own capture covers through this loop
    # refused for a decoder-layer bypass only: patchable with the runtime bypass guard
    # (embed / final_norm then say what the guarded patch inserts)
    with_guard: bool = False

    patchable = Reads("layers")

    @property
    def patchable_with_guard(self) -> bool:
        return self.layers or self.with_guard

    @property
    def where(self) -> str:
        """``PATH:LINE CLASS``"""
        return f"{self.path}:{self.line} {self.class_name}"


class Unparsed(NamedTuple):
    """A model file that cannot be read or parsed: its classes are not counted."""

    path: str
    reason: str


@dataclass(frozen=True)
class ClassCounts:
    """Loop-owning classes of one kind (decoders, or all): how many, and how many are patchable."""

    patchable: int
    total: int
    patchable_with_guard: int  # counting those patchable with the bypass guard

    @property
    def fraction(self) -> float:
        return self.patchable / self.total if self.total else 1.0

    @property
    def fraction_with_guard(self) -> float:
        return self.patchable_with_guard / self.total if self.total else 1.0


@dataclass(frozen=True)
class NonDecoderClasses:
    """The loop-owning classes that are not decoders (encoder towers fed with features), apart."""

    total: int
    patchable: int
    classes: list[str]  # PATH:LINE CLASS of each


@dataclass
class EngineCoverage:
    engine: str
    version: str
    root: str
    files: int  # model files read
    files_parsed: int  # of those, parsed with libcst
    classes: list[ClassCoverage] = field(default_factory=list)
    seconds: float = 0.0
    probe_error: str | None = None
    unparsed: list[Unparsed] = field(default_factory=list)
    platform: str = "all"  # what the native column holds for (vLLM picks some classes per platform)
    # per models directory of the release (vLLM 0.33: model_executor/models and models/): model
    # files, files with a layer loop, and registered architectures whose registry module is there
    trees: list[dict] = field(default_factory=list)

    def _counts(self, decoder_only: bool) -> ClassCounts:
        cs = [c for c in self.classes if c.decoder or not decoder_only]
        return ClassCounts(sum(c.patchable for c in cs), len(cs), sum(c.patchable_with_guard for c in cs))

    @property
    def decoder(self) -> ClassCounts:
        """The decoder classes: what a draft reads, what :attr:`fraction` is over."""
        return self._counts(True)

    @property
    def all(self) -> ClassCounts:
        """Every loop-owning class, encoder towers included."""
        return self._counts(False)

    @property
    def non_decoder(self) -> NonDecoderClasses:
        others = [c for c in self.classes if not c.decoder]
        return NonDecoderClasses(len(others), sum(c.patchable for c in others), [c.where for c in others])

    @property
    def decoder_failures(self) -> list[str]:
        """``PATH:LINE CLASS`` of each decoder class not patchable (without the bypass guard)."""
        return [c.where for c in self.classes if c.decoder and not c.patchable]

    @property
    def native(self) -> int:
        """How many classes the engine captures natively through."""
        return sum(bool(c.native) for c in self.classes)

    @property
    def final_norm(self) -> int:
        """How many classes take the final-norm capture."""
        return sum(c.final_norm for c in self.classes)

    fraction = Reads("decoder.fraction")
    fraction_all = Reads("all.fraction")

    @property
    def fraction_guarded(self) -> float:
        """Decoder classes patchable, counting those patchable with the bypass guard."""
        return self.decoder.fraction_with_guard


@dataclass
class CoverageReport:
    engines: list[EngineCoverage]
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------
# The ast prefilter (anatomy.loops_over_ast: a superset of the loops the anatomy reads)
# ---------------------------------------------------------------------------------------------
def loop_owners_ast(source: str | bytes, pairs: set[tuple[str, str]] | None = None) -> list[tuple[str, str, int, bool]]:
    """``(class, method, line, decoder)`` for every top-level class whose ``method`` loops over
    ``self.<attr>``, for each ``(method, attr)`` of ``pairs`` (default: forward / layers)."""
    return _scan(source, pairs)[0]


def _scan(source: str | bytes, pairs: set[tuple[str, str]] | None = None):
    """The loop owners, and the line spans (1-based, inclusive) of what the rewriter reads: the
    top-level imports and the owning classes."""
    pairs = pairs or {("forward", "layers")}
    if not any(f"self.{a}".encode() in (source if isinstance(source, bytes) else source.encode())
               for _, a in pairs):
        return [], []
    tree = ast.parse(source)
    out = []
    spans = [ast_span(st) for st in tree.body if isinstance(st, (ast.Import, ast.ImportFrom))]
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            attrs = [a for meth, a in pairs if meth == fn.name]
            if attrs and any(loops_over_ast(fn, a) for a in attrs):
                a = fn.args
                params = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
                out.append((cls.name, fn.name, cls.lineno, bool(params & _DECODER_PARAMS)))
                spans.extend(_class_spans(cls, {meth for meth, _ in pairs}))
                break
    return out, spans


def _class_spans(cls: ast.ClassDef, methods: set[str]) -> list[tuple[int, int]]:
    """What the planner reads of a loop-owning class: its header through its first statement (the
    block libcst takes the class's indent from) and the methods a recipe may name; the rest of
    the class (weight loading, helpers: most of its lines) is emptied, not parsed."""
    first = ast_span(cls)[0]
    spans = [(first, ast_span(cls.body[0])[1])]
    spans += [ast_span(fn) for fn in cls.body[1:]
              if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name in methods]
    return spans


# ---------------------------------------------------------------------------------------------
# One file (in a worker)
# ---------------------------------------------------------------------------------------------
def _file_task(args) -> list[ClassCoverage]:
    engine, path, relpath, owners, spans = args
    recipes = _recipes_cached(load_recipes)
    try:  # read again in the worker: what was a regular file at the prefilter may be a FIFO now
        source = _read_model_file(path)
    except (OSError, UnsafeFile) as exc:
        return [ClassCoverage(relpath, c, meth, line, dec, False, False, False, reason=_why(exc))
                for c, meth, line, dec in owners]
    # the rewriter's own reduction (same line numbers; encoding cookie, BOM and default indent
    # kept exact, else the whole file), so that coverage reads what `surgeon apply` reads
    try:
        reduced = parse_reduced(source, spans)
        if reduced is not None:
            module, source = reduced
        else:
            module = parse(source, relpath)
    except Exception as exc:  # a file the reader cannot handle: each of its classes says so
        why = exc.reason if isinstance(exc, PatchApplicationError) else unreadable(exc)
        return [ClassCoverage(relpath, c, meth, line, dec, False, False, False, reason=why)
                for c, meth, line, dec in owners]
    out: list[ClassCoverage] = []
    for cls, meth, line, decoder in owners:
        try:
            out.append(_class_task(engine, recipes, module, source, relpath, cls, meth, line, decoder))
        except Exception as exc:  # one class the reader cannot handle never takes down the others
            out.append(ClassCoverage(relpath, cls, meth, line, decoder, False, False, False, reason=unreadable(exc)))
    return out


def _class_task(engine: str, recipes, module, source: bytes, relpath: str, cls: str, meth: str, line: int,
                decoder: bool) -> ClassCoverage:
    """One loop-owning class: which of layer outputs, embed and final norm the rewriter can capture."""
    recipe = find_recipe(recipes, engine=engine, relpath=relpath, class_name=cls)
    rname = None if recipe.name == "generic" else recipe.name
    checker = Checker(module, relpath=relpath, class_name=cls, recipe=recipe, source_bytes=source)

    def attempt(positions: set[int], final: bool, guard: bool = False) -> tuple[str | None, bool]:
        """(refusal or None, whether the refusal is a decoder-layer bypass)"""
        try:
            checker.check(positions, final, guard_bypass=guard)
            return None, False
        except PatchApplicationError as exc:
            return f"{exc.anchor}: {exc.reason}", ":bypass@" in exc.anchor

    def plans(guard: bool) -> tuple[str | None, bool, str | None, str | None]:
        if attempt(set(PROBE_POSITIONS) | {0}, True, guard)[0] is None:  # the usual case: one plan
            return None, False, None, None
        reason, bypass = attempt(set(PROBE_POSITIONS), False, guard)
        embed_reason = attempt({0}, False, guard)[0] if reason is None else reason
        return reason, bypass, embed_reason, attempt(set(), True, guard)[0]

    reason, bypass, embed_reason, final_reason = plans(False)
    layers, with_guard = reason is None, False
    if bypass:
        g_reason, _, g_embed, g_final = plans(True)
        if g_reason is None:
            with_guard, embed_reason, final_reason = True, g_embed, g_final
        else:  # the guard would not be enough: say so next to the bypass
            reason = f"{reason}; with --guard-bypass still: {g_reason}"
    return ClassCoverage(relpath, cls, meth, line, decoder, layers, embed_reason is None, final_reason is None,
                         reason=reason, embed_reason=embed_reason, final_norm_reason=final_reason, recipe=rname,
                         with_guard=with_guard)


_RECIPES = None


def _recipes_cached(loader):
    global _RECIPES
    if _RECIPES is None:
        _RECIPES = loader()
    return _RECIPES


def _native(engine: str, root: Path, platform: str | None = None) -> tuple[dict[tuple[str, str], list[str]], str | None]:
    """(loop-owner path, class) -> the probe's classified classes capturing through that loop
    (on ``platform``)."""
    try:
        from surgeon.engines.probes.probe import probe_engine

        probe = probe_engine(engine, root, platform=platform)
    except Exception as exc:  # the coverage still stands without the native column
        return {}, f"{type(exc).__name__}: {exc}"
    out: dict[tuple[str, str], list[str]] = {}
    for c in probe.classes.values():
        if c.status != "classified" or not c.loop_owner or ":" not in c.loop_owner:
            continue
        path, _, owner = c.loop_owner.partition(":")
        out.setdefault((path, owner.split(".")[0]), []).append(c.class_name)
    return out, None


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------
def _prefilter(engine: str, root: Path, models_dirs: tuple[str, ...], recipes,
               reduce: bool = True) -> tuple[int, list, list[Unparsed]]:
    """(model files, libcst tasks, (file, why) for the files that cannot be read or parsed), over
    every models directory of the release"""
    pairs_default = {("forward", "layers")}
    tasks = []
    unparsed = []
    files = sorted({f for d in models_dirs if (root / d).is_dir() for f in (root / d).rglob("*.py")
                    if "__pycache__" not in f.parts})
    for f in files:
        relpath = f.relative_to(root).as_posix()
        pairs = set(pairs_default)
        for r in recipes:
            if r.engine in (None, engine) and r.file is not None and (relpath == r.file or relpath.endswith("/" + r.file)):
                pairs.add((r.method, r.layers_attr))
        try:
            owners, spans = _scan(_read_model_file(f), pairs)
        except (SyntaxError, ValueError, OSError, UnsafeFile) as exc:  # ValueError: null bytes, bad encoding
            unparsed.append(Unparsed(relpath, _why(exc)))
            continue
        if owners:
            tasks.append((engine, str(f), relpath, owners, spans if reduce else None))
    return len(files), tasks, unparsed


def _read_model_file(path: str | Path) -> bytes:
    """A model file's bytes through :mod:`surgeon.core.safefile`: links followed, but a FIFO, a
    device or a file over :data:`SOURCE_LIMIT` is refused (:class:`UnsafeFile`), never waited on."""
    return safe_read_bytes(path, limit=SOURCE_LIMIT, follow=True, what="the model file")


def _why(exc: Exception) -> str:
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"line {exc.lineno}: {exc.msg}"
    if isinstance(exc, OSError):
        return f"cannot be read: {exc.strerror or exc}"
    if isinstance(exc, UnsafeFile):
        return f"cannot be read: {str(exc).splitlines()[0]}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _trees(engine: str, loc, tasks: list, nfiles: int) -> list[dict]:
    """Counts per models directory: model files, files and classes with a layer loop, and (vLLM)
    the registered architectures whose registry module lives there."""
    from surgeon.engines.probes import vllm as probe_vllm
    from surgeon.engines.source.index import SourceIndex

    routed: dict[str, int] = {}
    if engine == "vllm":
        index = SourceIndex(loc.root, loc.layout.package, loc.models_dirs)
        for module, _ in probe_vllm.dispatched(index).values():
            path = index.path_of(module)
            d = next((d for d in loc.models_dirs if path and path.startswith(d + "/")), None)
            if d is not None:
                routed[d] = routed.get(d, 0) + 1
    out = []
    for d in loc.models_dirs:
        mine = [t for t in tasks if t[2].startswith(d + "/")]
        files = sum(1 for f in (loc.root / d).rglob("*.py") if "__pycache__" not in f.parts)
        out.append({"dir": d, "files": files, "files_with_loops": len(mine),
                    "loop_classes": sum(len(t[3]) for t in mine),
                    "decoder_classes": sum(1 for t in mine for o in t[3] if o[3]),
                    "registered_architectures": routed.get(d) if d != loc.layout.models_dir else None})
    return out


def coverage(engine: str, root: Path | str | None = None, *, jobs: int | None = None,
             native: bool = True, platform: str | None = None) -> CoverageReport:
    """Patch coverage of ``engine`` ("sglang", "vllm" or "all") at ``root`` (package directory or a
    folder holding it; None: the installed one), over every models directory of the release.
    ``jobs``: worker processes (default 2; 1: none). ``platform``: what the native column holds
    for (vLLM; default cuda)."""
    t0 = time.perf_counter()
    engines = ["sglang", "vllm"] if engine == "all" else [engine]
    recipes = load_recipes()
    jobs = 2 if jobs is None else max(1, jobs)
    located = [(e, _located(e, root)) for e in engines]
    if jobs == 1:
        plans = [(e, loc, *_prefilter(e, loc.root, loc.models_dirs, recipes)) for e, loc in located]
        results: dict[int, list[ClassCoverage]] = {i: [] for i in range(len(plans))}
        for i, t in _biggest_first(plans):
            results[i] += _file_task(t)
        natives = {i: _native(e, loc.root, platform if e == "vllm" else None)
                   for i, (e, loc) in enumerate(located)} if native else {}
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            # the probe (the longest single piece, itself in two processes) starts first; the
            # prefilter here and the file tasks in the pool fill the cores beside it
            nat_futs = ({i: pool.submit(_native, e, loc.root, platform if e == "vllm" else None)
                         for i, (e, loc) in enumerate(located)}
                        if native else {})
            plans = [(e, loc, *_prefilter(e, loc.root, loc.models_dirs, recipes)) for e, loc in located]
            results = {i: [] for i in range(len(plans))}
            futs = [(i, pool.submit(_file_task, t)) for i, t in _biggest_first(plans)]
            for i, fut in futs:
                results[i] += fut.result()
            natives = {i: f.result() for i, f in nat_futs.items()}
    report = CoverageReport([])
    for i, (e, loc, nfiles, tasks, unparsed) in enumerate(plans):
        nat, err = natives.get(i, ({}, None))
        classes = sorted(results[i], key=lambda c: (c.path, c.line))
        classes = [_with_native(c, nat) for c in classes]
        report.engines.append(EngineCoverage(e, loc.version, str(loc.root), nfiles, len(tasks), classes,
                                             probe_error=err, unparsed=unparsed,
                                             platform=(platform or "cuda") if e == "vllm" else "all",
                                             trees=_trees(e, loc, tasks, nfiles)))
    report.seconds = time.perf_counter() - t0
    for ec in report.engines:
        ec.seconds = report.seconds
    return report


def _located(engine: str, root: Path | str | None):
    try:
        layout_of(engine)  # an unknown engine name is the user's input
        return locate_engine(engine, root)
    except ProbeError as exc:  # a wrong engine or --engine-root: the user's input
        where = f"--engine-root {root}" if root is not None else engine
        raise BadInput(f"{where}: {exc}") from None


def _biggest_first(plans: list) -> list:
    """(plan index, file task), the biggest files first: that keeps the workers even."""
    tasks = [(i, t) for i, (_, _, _, tasks, _) in enumerate(plans) for t in tasks]
    return sorted(tasks, key=lambda it: -os.path.getsize(it[1][1]))


def _with_native(c: ClassCoverage, nat: dict) -> ClassCoverage:
    names = nat.get((c.path, c.class_name))
    if not names:
        return c
    from dataclasses import replace

    return replace(c, native=tuple(sorted(set(names))))


# ---------------------------------------------------------------------------------------------
# Rendering (for `surgeon coverage`)
# ---------------------------------------------------------------------------------------------
def render_coverage_lines(report: CoverageReport, *, all_classes: bool = True) -> list[str]:
    """Per engine: the counts (decoder classes; encoder towers apart), each models directory, the
    decoder classes (failures, or all with ``all_classes``), then the non-decoder classes apart:
    their loops run encoder blocks, not the residual stream a draft reads."""
    lines = []
    for ec in report.engines:
        dec, every = ec.decoder, ec.all
        lines.append(f"{ec.engine} {ec.version} (native capture for platform {ec.platform}): "
                     f"{dec.patchable}/{dec.total} decoder "
                     f"classes patchable ({ec.fraction:.1%}), {dec.patchable_with_guard} with the "
                     f"bypass guard ({ec.fraction_guarded:.1%}); {every.patchable}/{every.total} "
                     f"with encoder towers; {ec.files_parsed} of {ec.files} files parsed with libcst")
        for t in ec.trees:
            reg = (f", {t['registered_architectures']} registered architectures"
                   if t["registered_architectures"] is not None else "")
            lines.append(f"  {t['dir']}/: {t['files']} files, {t['files_with_loops']} with a layer loop "
                         f"({t['loop_classes']} classes, {t['decoder_classes']} decoders){reg}")
        if ec.probe_error:
            lines.append(f"  native capture unknown: {ec.probe_error}")
        for path, why in ec.unparsed:
            lines.append(f"  ERR {path}: does not parse ({why}): its classes are not counted")
        decoders = [c for c in ec.classes if c.decoder and (all_classes or not c.patchable)]
        lines += _class_lines(decoders)
        others = [c for c in ec.classes if not c.decoder and (all_classes or not c.patchable)]
        if others:
            lines.append(f"  not decoders ({ec.non_decoder.total} encoder towers and other loops fed with "
                         f"features, not counted in the decoder fraction; {ec.non_decoder.patchable} patchable):")
            lines += _class_lines(others)
    return lines


def _class_lines(classes: list[ClassCoverage]) -> list[str]:
    lines = []
    for c in classes:
        what = ",".join(k for k, v in (("layers", c.layers), ("embed", c.embed), ("final_norm", c.final_norm)) if v)
        tag = "ok " if c.patchable else "GRD" if c.with_guard else "NO "
        kind = "" if c.decoder else " [encoder]"
        nat = f" native: {', '.join(c.native)}" if c.native else ""
        lines.append(f"  {tag}{c.path}:{c.line} {c.class_name}.{c.method}{kind} [{what or '-'}]{nat}")
        for label, r in (("", c.reason), ("embed: ", c.embed_reason if c.layers else None),
                         ("final_norm: ", c.final_norm_reason if c.layers else None)):
            if r:
                lines.append(f"       {label}{r}")
    return lines


def render_coverage_table(report: CoverageReport):
    """A rich Table: one row per loop-owning class."""
    from rich.table import Table

    table = Table(title="patch coverage", show_lines=False)
    for col in ("engine", "file", "class", "kind", "layers", "with guard", "embed", "final_norm", "native", "reason"):
        table.add_column(col, overflow="fold")
    for ec in report.engines:
        for c in ec.classes:
            yes = lambda v: "yes" if v else "no"
            table.add_row(ec.engine, f"{c.path}:{c.line}", c.class_name, "decoder" if c.decoder else "encoder",
                          yes(c.layers), yes(c.patchable_with_guard), yes(c.embed), yes(c.final_norm),
                          ", ".join(c.native),
                          c.reason or (c.final_norm_reason and f"final_norm: {c.final_norm_reason}") or "")
    table.caption = "; ".join(f"{ec.engine}: {ec.fraction:.0%} of decoder classes patchable, {ec.fraction_guarded:.0%} "
                              "with the bypass guard" for ec in report.engines)
    return table
