"""Read an engine release's own capture route and plugin mechanism from its source, never imported.

Files are found by the names they carry, never by a path assumed to exist: the package's ``.py``
files under a few top folders are searched for a string (``extract_hidden_states``,
``enable_return_aux_hidden_states``, ``vllm.general_plugins``, ``SGLANG_EXTERNAL_MODEL_PACKAGE``),
and the matches are parsed with :mod:`ast` and read by name:

* vLLM: the speculative method (a ``Literal[...]`` holding ``"extract_hidden_states"``), the
  proposer classes that ``getattr(..., "eagle_aux_hidden_state_layer_ids")``, and the KV connector
  class (one defining ``save_kv_layer`` in a file naming the method) registered by its name; their
  ``raise``/``assert`` checks (classified by the names in the test and the message), what the
  connector writes (the ``.safetensors`` name, the tensor keys, ``pin_memory=True``).
* SGLang: the ``enable_return_aux_hidden_states`` field, the check that reads it (the algorithms it
  accepts, its refusals), where the runner reads ``return_aux_hidden_state_layer_ids`` and the model
  setters ``set_<algo>_layers_to_capture`` it calls.
* Plugins: the entry-point group or the environment variable, and what happens to a plugin's error.

What is not found is reported with what was searched ("not found in vllm 0.11.0: ..."); a bad root
gives ``available=False`` with the reason, never a traceback.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from surgeon.core.routefacts import NativeCapture, PluginLoader, RouteCondition, RouteFacts, SourceCite
from surgeon.engines.probes.runner import RunnerReader, _conditions, _enclosing, _Module, _qualname
from surgeon.engines.source.locate import ProbeError, locate_engine

_Fn = ast.FunctionDef | ast.AsyncFunctionDef

# Check kinds, tried in order on a check's test and message; the first whose names occur decides.
# The same names locate the cited line inside the check.
CODES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mla", ("MLA",)),
    ("pp", ("pp_size", "pipeline_parallel", "pipeline rank")),
    ("draft", ("draft_model_path", "draft-model-path")),
    ("spec_tokens", ("num_speculative",)),
    ("sampling", ("greedy", "draft_sample_method")),
    ("padded_batch", ("disable_padded_drafter_batch",)),
    ("algorithm", ("speculative-algorithm", "speculative_algorithm")),
    ("ids", ("layer_ids", "layer-ids")),
    ("block_size", ("block-size", "block_size")),
    ("aux_capture", ("aux_hidden_states", "layers_to_capture")),
)
SETTER = re.compile(r"^set_(\w+?)_layers_to_capture$")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


@dataclass(frozen=True)
class _Check:
    """One ``raise`` (or ``assert``) found: its classification and the line cited."""

    code: str
    text: str
    line: int


class Release:
    """One engine release's files, searched by content and read once (through the runner reader's
    safe reads and parse cache)."""

    def __init__(self, engine: str, root: Path, version: str) -> None:
        self.engine, self.root, self.version = engine, Path(root), version
        self.reader = RunnerReader(engine, self.root)
        self.searched: dict[str, int] = {}  # folder -> .py files read there

    def files(self, folder: str) -> list[str]:
        base = self.root / folder
        try:
            if base.is_file():
                return [folder]
            found = sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*.py")) if base.is_dir() else []
        except OSError:
            return []
        self.searched[folder] = len(found)
        return found

    def grep(self, needle: str, *folders: str) -> list[str]:
        """The files under ``folders`` whose text holds ``needle`` (unreadable files count as read)."""
        return [rel for folder in folders for rel in self.files(folder) if needle in (self.reader.text(rel) or "")]

    def module(self, rel: str) -> _Module | None:
        return self.reader.module(rel)

    def line(self, rel: str, line: int) -> str:
        lines = (self.reader.text(rel) or "").splitlines()
        return lines[line - 1].strip() if 0 < line <= len(lines) else ""

    def cite(self, rel: str, line: int) -> SourceCite:
        return SourceCite(rel, line, self.line(rel, line))

    def line_with(self, rel: str, node: ast.AST, names: tuple[str, ...]) -> int | None:
        """The first line of ``node``'s span that holds one of ``names`` (None: none does)."""
        first: int = getattr(node, "lineno", 0)
        last: int = getattr(node, "end_lineno", None) or first
        return next((n for n in range(first, last + 1) if any(x in self.line(rel, n) for x in names)), None)

    def searched_text(self, *folders: str) -> str:
        parts = [f"{f}/ ({self.searched.get(f, 0)} files)" if not f.endswith(".py") else f for f in folders]
        return ", ".join(parts)

    def label(self) -> str:
        return f"{self.engine} {self.version}"

    # -- checks ----------------------------------------------------------------------------------
    def checks(self, rel: str, scope: ast.AST, *, coded_only: bool = False, skip: str | None = None) -> list[_Check]:
        """The ``raise`` statements in ``scope`` (and its ``assert`` statements that classify),
        each with its enclosing conditions; ``skip``: drop checks under ``not (...<skip>...)``."""
        mod = self.module(rel)
        if mod is None:
            return []
        out = []
        for node in ast.walk(scope):
            if not isinstance(node, (ast.Raise, ast.Assert)):
                continue
            found = self._check(rel, mod, node, skip)
            if found is not None and (found.code != "check" or not (coded_only or isinstance(node, ast.Assert))):
                out.append(found)
        return sorted(out, key=lambda c: c.line)

    def _check(self, rel: str, mod: _Module, node: ast.Raise | ast.Assert, skip: str | None) -> _Check | None:
        fn = _enclosing(mod, node)
        test = ast.unparse(node.test) if isinstance(node, ast.Assert) else _conditions(mod, node, fn or mod.tree)
        if skip and test and re.search(rf"\bnot \(?[\w.]*\b{re.escape(skip)}\b", test):
            return None
        message = _message(node)
        blob = f"{test or ''} {message}"
        code, names = next(((c, n) for c, n in CODES if any(x in blob for x in n)), ("check", ()))
        where = fn.name if fn is not None else "module"
        kind = "assert" if isinstance(node, ast.Assert) else _raised(node)
        text = f"{_qualname(mod, fn) if fn else where}: {kind}" + (f" when {test}" if test else "")
        text += f": {message}" if message else ""
        scope = node if isinstance(node, ast.Assert) else mod.parents.get(node, node)
        line = (self.line_with(rel, node, names) or self.line_with(rel, scope, names) or node.lineno) if names else node.lineno
        return _Check(code, " ".join(text.split()), line)

    def conditions(self, rel: str, found: list[_Check]) -> tuple[RouteCondition, ...]:
        return tuple(RouteCondition(c.code, c.text, self.cite(rel, c.line)) for c in found)


def _raised(node: ast.Raise) -> str:
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    return f"raises {ast.unparse(exc)}" if exc is not None else "raises"


def _message(node: ast.Raise | ast.Assert) -> str:
    """The string parts of a check's message, joined (an f-string's fields as ``{...}``)."""
    msg: ast.expr | None = node.msg if isinstance(node, ast.Assert) else None
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
        msg = node.exc.args[0]
    if msg is None:
        return ""
    if isinstance(msg, ast.Constant) and isinstance(msg.value, str):
        return msg.value
    if isinstance(msg, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else "{...}" for v in msg.values)
    return ast.unparse(msg)


def _classes(mod: _Module) -> Iterator[ast.ClassDef]:
    return (n for n in ast.walk(mod.tree) if isinstance(n, ast.ClassDef))


def _functions(scope: ast.AST) -> Iterator[_Fn]:
    return (n for n in ast.walk(scope) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _str_const(node: ast.AST, value: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == value


def _calls(scope: ast.AST, name: str) -> Iterator[ast.Call]:
    """Calls in ``scope`` of a function or method called ``name``."""
    for n in ast.walk(scope):
        if isinstance(n, ast.Call):
            f = n.func
            if (isinstance(f, ast.Attribute) and f.attr == name) or (isinstance(f, ast.Name) and f.id == name):
                yield n


# == vLLM ==========================================================================================
VLLM_METHOD = "extract_hidden_states"
VLLM_IDS = "eagle_aux_hidden_state_layer_ids"
VLLM_DIRS = {"method": ("config",), "proposer": ("v1",), "connector": ("distributed",)}
PREFIX_THREAD = "vllm#44485"
HYBRID_THREAD = "vllm#51328"


@dataclass
class _Proposer:
    rel: str
    cls: ast.ClassDef
    ids: SourceCite


class VllmRoute:
    """vLLM's ``extract_hidden_states`` speculative method and the connector that writes its states."""

    def __init__(self, rel: Release) -> None:
        self.r = rel

    def read(self) -> NativeCapture:
        r = self.r
        defined = self.method()
        if defined is None:
            return self._absent()
        proposers = self.proposers()
        connector = self.connector()
        files = tuple(sorted({defined.path, *(p.rel for p in proposers), *(c[0] for c in [connector] if c)}))
        if not proposers or connector is None:
            missing = "no proposer reads " + VLLM_IDS if not proposers else "no KV connector class writes the states"
            return NativeCapture("vllm", r.version, False, f"{VLLM_METHOD} is defined at {defined.where} but {missing} "
                                 f"(searched {r.searched_text(*VLLM_DIRS['proposer'], *VLLM_DIRS['connector'])})",
                                 defined=defined, files=files)
        crel, ccls, cname = connector
        refusals = tuple(c for p in proposers for c in r.conditions(p.rel, r.checks(p.rel, p.cls)))
        refusals += r.conditions(crel, r.checks(crel, ccls, coded_only=True))
        hazards = self.hazards(crel, ccls)
        writes = self.writes(crel, ccls, proposers)
        native = NativeCapture(
            "vllm", r.version, True,
            f"speculative method {VLLM_METHOD!r} ({defined.where}) with kv connector {cname!r} ({crel}:{ccls.lineno}); "
            f"ids read at {proposers[0].ids.where}",
            switch=(VLLM_METHOD, cname), defined=defined, ids_read=proposers[0].ids, refusals=refusals,
            hazards=hazards, writes=writes, final_state=self.final_state(proposers),
            id_reads=tuple(p.ids for p in proposers), files=files)
        return native

    def _absent(self) -> NativeCapture:
        r = self.r
        anywhere = r.grep(VLLM_METHOD, ".")
        where = f"; it occurs in {', '.join(anywhere)}" if anywhere else f"; nor anywhere in the package ({r.searched_text('.')})"
        return NativeCapture("vllm", r.version, False,
                             f"not found in {r.label()}: no speculative method {VLLM_METHOD!r} in "
                             f"{r.searched_text(*VLLM_DIRS['method'])}{where}")

    def method(self) -> SourceCite | None:
        """Where a ``Literal[...]`` of the speculative config names the method."""
        for rel in self.r.grep(VLLM_METHOD, *VLLM_DIRS["method"]):
            mod = self.r.module(rel)
            for node in ast.walk(mod.tree) if mod else ():
                if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal"
                        and any(_str_const(c, VLLM_METHOD) for c in ast.walk(node.slice))):
                    line = self.r.line_with(rel, node, (f'"{VLLM_METHOD}"', f"'{VLLM_METHOD}'")) or node.lineno
                    return self.r.cite(rel, line)
        return None

    def proposers(self) -> list[_Proposer]:
        """Classes under v1/ that read the ids with ``getattr(..., "eagle_aux_hidden_state_layer_ids")``."""
        out = []
        for rel in self.r.grep(VLLM_IDS, *VLLM_DIRS["proposer"]):
            text = self.r.reader.text(rel) or ""
            mod = self.r.module(rel) if VLLM_METHOD in text and "def propose(" in text else None
            for cls in _classes(mod) if mod else ():
                if not any(isinstance(f, ast.FunctionDef) and f.name == "propose" for f in cls.body):
                    continue  # the runner reads the ids too, to hand them to the model; the proposer proposes
                read = next((c for c in _calls(cls, "getattr") if len(c.args) >= 2 and _str_const(c.args[1], VLLM_IDS)), None)
                if read is not None:
                    line = self.r.line_with(rel, read, (VLLM_IDS,)) or read.lineno
                    out.append(_Proposer(rel, cls, self.r.cite(rel, line)))
        return out

    def connector(self) -> tuple[str, ast.ClassDef, str] | None:
        """The KV connector class (it defines ``save_kv_layer``) in a file naming the method, and
        the name it is registered under (a call passing the class name as a string)."""
        folders = VLLM_DIRS["connector"]
        for rel in self.r.grep(VLLM_METHOD, *folders):
            mod = self.r.module(rel) if "def save_kv_layer" in (self.r.reader.text(rel) or "") else None
            for cls in _classes(mod) if mod else ():
                if any(f.name == "save_kv_layer" for f in cls.body if isinstance(f, ast.FunctionDef)):
                    if self._registered(cls.name, folders):
                        return rel, cls, cls.name
        return None

    def _registered(self, name: str, folders: tuple[str, ...]) -> bool:
        for rel in self.r.grep(f'"{name}"', *folders):
            mod = self.r.module(rel)
            if mod and any(isinstance(n, ast.Call) and n.args and _str_const(n.args[0], name) for n in ast.walk(mod.tree)):
                return True
        return False

    def hazards(self, rel: str, cls: ast.ClassDef) -> tuple[RouteCondition, ...]:
        r = self.r
        out: list[RouteCondition] = []
        for call in ast.walk(cls):
            if isinstance(call, ast.Call) and any(k.arg == "pin_memory" and isinstance(k.value, ast.Constant)
                                                  and k.value.value is True for k in call.keywords):
                fn = _enclosing(r.module(rel), call)  # type: ignore[arg-type]
                out.append(RouteCondition("pin_memory", f"{fn.name if fn else cls.name}: {ast.unparse(call)}: pinned host "
                                          "memory, which raises where no accelerator is present (CPU)",
                                          r.cite(rel, r.line_with(rel, call, ("pin_memory",)) or call.lineno)))
                break
        cuda = next((n for n in ast.walk(cls) if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("torch.cuda.")), None)
        if cuda is not None:
            out.append(RouteCondition("cuda", f"the writer calls {ast.unparse(cuda)} (CUDA streams and events)",
                                      r.cite(rel, cuda.lineno)))
        out.append(RouteCondition("prefix_caching", f"{PREFIX_THREAD}: with prefix caching the hidden_states rows are "
                                  "shorter than token_ids (not read from the source)", None, PREFIX_THREAD, read=False))
        hybrid = next((c for c in r.checks(rel, cls) if "hybrid" in c.text), None)
        guard = f"; the connector's own check ({rel}:{hybrid.line}) covers a block-size mismatch only" if hybrid else ""
        out.append(RouteCondition("hybrid", f"{HYBRID_THREAD}: hybrid verifiers get zero/NaN rows (not read from the "
                                  f"source){guard}", r.cite(rel, hybrid.line) if hybrid else None, HYBRID_THREAD, read=False))
        out.append(RouteCondition("pp", "undecided: no pipeline-parallel check in the proposer or connector files read; "
                                  "whether aux states of layers on earlier pipeline ranks reach the writer was not read", None))
        return tuple(out)

    def writes(self, rel: str, cls: ast.ClassDef, proposers: list[_Proposer]) -> tuple[str, ...]:
        """The file name pattern and where it goes, the tensor keys, and the states' shape."""
        out = []
        name = next((n for n in ast.walk(cls) if isinstance(n, ast.JoinedStr) and any(
            isinstance(v, ast.Constant) and str(v.value).endswith(".safetensors") for v in n.values)), None)
        if name is not None:
            out.append(f"one file per request, {ast.unparse(name)}{_storage(cls)} ({rel}:{name.lineno})")
        keys = next((n for n in ast.walk(cls) if isinstance(n, ast.Dict)
                     and any(k is not None and _str_const(k, "hidden_states") for k in n.keys)), None)
        if keys is not None:
            out.append(f"tensors {', '.join(ast.unparse(k) for k in keys.keys if k is not None)} ({rel}:{keys.lineno})")
        for p in proposers:
            stack = _stack(p.cls)
            if stack is not None:
                out.append(f"hidden_states [T, n, H]: the model's aux states, {ast.unparse(stack)}, n = len({VLLM_IDS}), "
                           f"in the order the class's capture list holds them ({p.rel}:{stack.lineno})")
        return tuple(out)

    def final_state(self, proposers: list[_Proposer]) -> RouteCondition | None:
        for p in proposers:
            stack = _stack(p.cls)
            if stack is not None:
                return RouteCondition("final_norm", f"cannot: the writer stacks only the aux states the model's layer loop "
                                      f"records ({ast.unparse(stack)}); the model's output after the final norm is not "
                                      "handed to it", self.r.cite(p.rel, stack.lineno))
        return RouteCondition("final_norm", "undecided: no torch.stack of the aux states found in the proposers", None)


def _stack(cls: ast.ClassDef) -> ast.Call | None:
    """The ``torch.stack(<aux states>, dim=...)`` a proposer builds its buffer rows with."""
    return next((c for c in _calls(cls, "stack") if any(k.arg == "dim" for k in c.keywords)), None)


def _storage(cls: ast.ClassDef) -> str:
    """Where the connector writes: its ``get_from_extra_config("shared_storage_path", default)``."""
    store = next((c for c in _calls(cls, "get_from_extra_config")
                  if len(c.args) > 1 and _str_const(c.args[0], "shared_storage_path")), None)
    if store is None:
        return ""
    return f" under kv_connector_extra_config {ast.unparse(store.args[0])} (default {ast.unparse(store.args[1])})"


# == SGLang ========================================================================================
SGL_FLAG = "enable_return_aux_hidden_states"
SGL_IDS = "return_aux_hidden_state_layer_ids"
SGL_DIRS = {"flag": ("srt",), "runner": ("srt/model_executor",), "layers": ("srt/layers",)}


class SglangRoute:
    """SGLang's ``--enable-return-aux-hidden-states``: aux capture on the target, no draft."""

    def __init__(self, rel: Release) -> None:
        self.r = rel

    def read(self) -> NativeCapture:
        r = self.r
        hits = r.grep(SGL_FLAG, *SGL_DIRS["flag"])
        defined = self.defined(hits)
        if defined is None:
            return NativeCapture("sglang", r.version, False, self._absent_reason())
        check = self.validator(hits)
        if check is None:
            return NativeCapture("sglang", r.version, False, f"{_flag(SGL_FLAG)} is defined at {defined.where} but no "
                                 "check reading it names the algorithms it accepts", defined=defined)
        vrel, vfn, algorithms, switch = check
        ids_read, ids_fn = self.ids_read()
        setters, setter_checks = self.setters(algorithms)
        refusals = r.conditions(vrel, r.checks(vrel, vfn, skip=SGL_FLAG))
        refusals += tuple(c for rel, fn in ids_fn for c in r.conditions(rel, r.checks(rel, fn)))
        refusals += setter_checks
        files = tuple(sorted({defined.path, vrel, *(rel for rel, _ in ids_fn), *(s[2].path for s in setters)}))
        ok = bool(setters) and ids_read is not None
        reason = (f"{' '.join(switch)} ({defined.where}, checked in {vfn.name} at {vrel}:{vfn.lineno})" if ok else
                  f"{_flag(SGL_FLAG)} is defined at {defined.where} but " +
                  ("no runner read of " + SGL_IDS if ids_read is None else "no model setter call") + " was found")
        return NativeCapture("sglang", r.version, ok, reason, switch=switch, defined=defined, ids_read=ids_read,
                             algorithms=algorithms, setters=setters, refusals=refusals, hazards=self.hazards(),
                             writes=self.writes(), final_state=self.final_state(ids_fn), files=files,
                             id_reads=(ids_read,) if ids_read else ())

    def _absent_reason(self) -> str:
        r = self.r
        why = f"not found in {r.label()}: no {SGL_FLAG!r} in {r.searched_text(*SGL_DIRS['flag'])}"
        last = self._field_cite("enable_return_hidden_states", r.grep("enable_return_hidden_states", *SGL_DIRS["flag"]))
        return why + (f"; only enable_return_hidden_states (the last layer's states) at {last.where}" if last else "")

    def _field_cite(self, field: str, hits: list[str]) -> SourceCite | None:
        for rel in hits:
            mod = self.r.module(rel)
            for n in ast.walk(mod.tree) if mod else ():
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == field:
                    return self.r.cite(rel, n.lineno)
        return None

    def defined(self, hits: list[str]) -> SourceCite | None:
        return self._field_cite(SGL_FLAG, hits)

    def validator(self, hits: list[str]) -> tuple[str, _Fn, tuple[str, ...], tuple[str, ...]] | None:
        """The function that tests the flag and compares the algorithm against a tuple of names."""
        for rel in hits:
            mod = self.r.module(rel)
            if mod is None:
                continue
            for fn in _functions(mod.tree):
                if not any(isinstance(n, ast.Attribute) and n.attr == SGL_FLAG for n in ast.walk(fn)):
                    continue
                found = self._algorithms(mod, fn)
                if found is not None:
                    algorithms, field = found
                    ids = next((n.attr for n in ast.walk(fn)
                                if isinstance(n, ast.Attribute) and n.attr.endswith("layer_ids")), None)
                    switch = (_flag(SGL_FLAG), _flag(field), *((_flag(ids),) if ids else ()))
                    return rel, fn, algorithms, switch
        return None

    @staticmethod
    def _algorithms(mod: _Module, fn: _Fn) -> tuple[tuple[str, ...], str] | None:
        """(names, the server field they are read from) of a ``x not in NAMES`` test in ``fn``."""
        tuples = {t.id: n.value for n in mod.tree.body if isinstance(n, ast.Assign) for t in n.targets
                  if isinstance(t, ast.Name) and isinstance(n.value, ast.Tuple)}
        for cmp in (n for n in ast.walk(fn) if isinstance(n, ast.Compare)):
            right = cmp.comparators[0]
            values = tuples.get(right.id) if isinstance(right, ast.Name) else right if isinstance(right, ast.Tuple) else None
            if not isinstance(cmp.ops[0], ast.NotIn) or values is None or not isinstance(cmp.left, ast.Name):
                continue
            names = tuple(e.value for e in values.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
            source = [v for a in ast.walk(fn) if isinstance(a, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == cmp.left.id for t in a.targets) for v in ast.walk(a.value)]
            field = next((v.attr for v in source if isinstance(v, ast.Attribute) and "algorithm" in v.attr), None)
            if names and field:
                return names, field
        return None

    def ids_read(self) -> tuple[SourceCite | None, list[tuple[str, _Fn]]]:
        """The first runner read of ``.return_aux_hidden_state_layer_ids``, and the functions that
        read it together with the module functions they call (their checks are refusals)."""
        first: SourceCite | None = None
        fns: list[tuple[str, _Fn]] = []
        for rel in self.r.grep(SGL_IDS, *SGL_DIRS["runner"]):
            mod = self.r.module(rel)
            if mod is None:
                continue
            local = {f.name: f for f in mod.tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for node in (n for n in ast.walk(mod.tree) if isinstance(n, ast.Attribute) and n.attr == SGL_IDS):
                fn = _enclosing(mod, node)
                if fn is None or any(f is fn for _, f in fns):
                    continue
                first = first or self.r.cite(rel, node.lineno)
                fns.append((rel, fn))
                fns += [(rel, local[c.func.id]) for c in ast.walk(fn) if isinstance(c, ast.Call)
                        and isinstance(c.func, ast.Name) and c.func.id in local]
        return first, fns

    def setters(self, algorithms: tuple[str, ...]) -> tuple[tuple[tuple[str, str, SourceCite], ...], tuple[RouteCondition, ...]]:
        """(algorithm, setter, where) for each ``model.set_<algo>_layers_to_capture(...)`` call in the
        runner; a call in the ``else`` of a test naming another algorithm's setter is that
        algorithm's fallback. And the checks of the functions holding the calls."""
        out: list[tuple[str, str, SourceCite]] = []
        checks: tuple[RouteCondition, ...] = ()
        for rel in self.r.grep("_layers_to_capture(", *SGL_DIRS["runner"]):
            mod = self.r.module(rel)
            holders: list[_Fn] = []
            for call, setter, fn in _setter_calls(mod) if mod else ():
                out += self._setter_entries(mod, rel, call, setter, algorithms, fn)  # type: ignore[arg-type]
                holders += [fn] if fn not in holders else []
            checks += tuple(c for fn in holders for c in self.r.conditions(rel, self.r.checks(rel, fn, coded_only=True)))
        order = {a: i for i, a in enumerate(algorithms)}
        return tuple(sorted(out, key=lambda s: order.get(s[0], len(order)))), checks

    def _setter_entries(self, mod: _Module, rel: str, call: ast.Call, setter: str, algorithms: tuple[str, ...],
                        fn: _Fn) -> list[tuple[str, str, SourceCite]]:
        algo = SETTER.match(setter).group(1)  # type: ignore[union-attr]
        cite = self.r.cite(rel, call.lineno)
        out = [(a, setter, cite) for a in algorithms if a.lower() == algo.lower()]
        when = _conditions(mod, call, fn) or ""
        for a in algorithms:
            if a.lower() != algo.lower() and re.search(rf"not \([^)]*set_{a.lower()}_layers_to_capture", when):
                out.append((a, setter, cite))
        return out

    def hazards(self) -> tuple[RouteCondition, ...]:
        return (RouteCondition("prefix_caching", "undecided: whether tokens served from the radix cache get aux rows "
                               "was not read", None, read=False),)

    def writes(self) -> tuple[str, ...]:
        for rel in self.r.grep("def pack_aux_hidden_states", *SGL_DIRS["layers"]):
            mod = self.r.module(rel)
            fn = next((f for f in _functions(mod.tree) if f.name == "pack_aux_hidden_states"), None) if mod else None
            cat = next(_calls(fn, "cat"), None) if fn else None
            if cat is not None:
                return (f"the response's hidden_states: the aux states joined on the last dim, {ast.unparse(cat)} "
                        f"[T, n*H] in the setter's order ({rel}:{cat.lineno})",)
        return ()

    def final_state(self, fns: list[tuple[str, _Fn]]) -> RouteCondition:
        for rel, fn in fns:
            bound = next((c for c in ast.walk(fn) if isinstance(c, ast.Compare) and isinstance(c.ops[0], ast.GtE)
                          and "layers" in ast.unparse(c.comparators[0])), None)
            if bound is not None:
                return RouteCondition("final_norm", f"cannot: every id names a layer of the model's loop; "
                                      f"{ast.unparse(bound)} is refused, so no id names the final norm's output",
                                      self.r.cite(rel, bound.lineno))
        return RouteCondition("final_norm", "undecided: no bound on the ids found where the runner reads them", None)


def _setter_calls(mod: _Module) -> Iterator[tuple[ast.Call, str, _Fn]]:
    """Each ``x.set_<algo>_layers_to_capture(...)`` call made outside a setter of that name."""
    for call in (n for n in ast.walk(mod.tree) if isinstance(n, ast.Call)):
        setter = call.func.attr if isinstance(call.func, ast.Attribute) else ""
        fn = _enclosing(mod, call) if SETTER.match(setter) else None
        if fn is not None and fn.name != setter:
            yield call, setter, fn


# == plugins =======================================================================================
class PluginReader:
    def __init__(self, rel: Release) -> None:
        self.r = rel

    def vllm(self) -> PluginLoader:
        r = self.r
        hits = r.grep("general_plugins", "plugins") or r.grep("general_plugins", ".")
        for rel in hits:
            mod = r.module(rel)
            const = next((n for n in ast.walk(mod.tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                          and str(n.value.value).endswith(".general_plugins")), None) if mod else None
            if mod is None or const is None or next(_calls(mod.tree, "entry_points"), None) is None:
                continue
            errors, cites = self._vllm_errors(rel, mod)
            return PluginLoader("vllm", r.version, True, "entry_points", str(const.value.value),  # type: ignore[attr-defined]
                                r.cite(rel, const.lineno), f"entry points of group {const.value.value!r} "  # type: ignore[attr-defined]
                                f"({rel}:{const.lineno})", errors, cites)
        return PluginLoader("vllm", r.version, False, "entry_points", "vllm.general_plugins", None,
                            f"not found in {r.label()}: no 'general_plugins' group with entry_points() in "
                            f"{r.searched_text('plugins')} or the package ({r.searched_text('.')})")

    def _vllm_errors(self, rel: str, mod: _Module) -> tuple[str | None, tuple[SourceCite, ...]]:
        parts, cites = [], []
        for load in _calls(mod.tree, "load"):
            handler = _catching(mod, load)
            if handler is not None:
                parts.append(f"a plugin that fails to import is logged and skipped ({rel}:{handler.lineno} "
                             f"{ast.unparse(handler.type) if handler.type else 'bare'} handler)")
                cites.append(self.r.cite(rel, handler.lineno))
                break
        for _loop, call in _loop_calls(mod):
            caught = _catching(mod, call)
            fn = _enclosing(mod, call)
            parts.append(f"an exception raised by a plugin's function is caught and logged ({rel}:{caught.lineno})" if caught
                         else f"an exception raised by a plugin's function is not caught in {fn.name if fn else 'the loop'} "
                              f"({rel}:{call.lineno} {ast.unparse(call)}): it stops the engine start")
            cites.append(self.r.cite(rel, call.lineno))
            break
        return ("; ".join(parts) or None), tuple(cites)

    def sglang(self) -> PluginLoader:
        r = self.r
        var = "SGLANG_EXTERNAL_MODEL_PACKAGE"
        for rel in r.grep(var, "srt"):
            mod = r.module(rel)
            use = next((n for n in ast.walk(mod.tree) if isinstance(n, ast.Attribute) and n.attr == var), None) if mod else None
            if mod is None or use is None:
                continue
            errors: str | None = None
            cites: tuple[SourceCite, ...] = ()
            for tr in (n for n in ast.walk(mod.tree) if isinstance(n, ast.Try)):
                if next((c for b in tr.body for c in _calls(b, "import_module")), None) is not None and tr.handlers:
                    h = tr.handlers[0]
                    strict = next((ast.unparse(s.test) for s in h.body if isinstance(s, ast.If)
                                   and any(isinstance(x, ast.Raise) for x in s.body)), None)
                    errors = (f"a module of the package that fails to import is logged and skipped ({rel}:{h.lineno})"
                              + (f", raised only when {strict}" if strict else ""))
                    cites = (r.cite(rel, h.lineno),)
                    break
            return PluginLoader("sglang", r.version, True, "env_package", var, r.cite(rel, use.lineno),
                                f"model classes of the package named by {var} ({rel}:{use.lineno})", errors, cites)
        return PluginLoader("sglang", r.version, False, "env_package", var, None,
                            f"not found in {r.label()}: no {var} read in {r.searched_text('srt')}")


def _loop_calls(mod: _Module) -> Iterator[tuple[ast.For, ast.Call]]:
    """``for f in ...: f()``: each loop that calls its own loop variable, with that call."""
    for loop in (n for n in ast.walk(mod.tree) if isinstance(n, ast.For) and isinstance(n.target, ast.Name)):
        name = loop.target.id  # type: ignore[attr-defined]
        call = next((c for c in ast.walk(loop) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                     and c.func.id == name), None)
        if call is not None:
            yield loop, call


def _catching(mod: _Module, node: ast.AST) -> ast.ExceptHandler | None:
    """The ``except Exception`` (or broader) handler of a ``try`` whose body holds ``node``."""
    cur: ast.AST | None = mod.parents.get(node)
    child: ast.AST = node
    while cur is not None and not isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if isinstance(cur, ast.Try) and child in cur.body:
            for h in cur.handlers:
                if h.type is None or ast.unparse(h.type) in ("Exception", "BaseException"):
                    return h
        child = cur
        cur = mod.parents.get(cur)
    return None


# == MLA attention =================================================================================
# An MLA attention class by its name: ``DeepseekV2MLAAttention``, ``DeepseekV2AttentionMLA``,
# ``MultiHeadLatentAttention[Wrapper]`` (not ``MLAAttentionSpec``, a KV-cache spec).
MLA_NAME = re.compile(r"^\w*(MLA\w*Attention|AttentionMLA|LatentAttention\w*)$")
MLA_DEPTH = 3  # model files followed through imports of model classes
INNER_BUILDERS = ("init_vllm_registered_model",)  # builds an inner model by architecture name


@dataclass
class _Reach:
    """What reading a class's files found: MLA constructions (cite, condition or None), inner
    models built by architecture name, imports not followed."""

    uses: list[tuple[SourceCite, str | None]]
    inner: list[SourceCite]
    unfollowed: list[str]


class MlaReader:
    """Whether a model class builds MLA attention: the classes it reaches in its model file (bases
    and the classes its body names, through imports of other model files) are read for a
    construction of a class named ``*MLA*``/``*LatentAttention*`` (a call of it, or its assignment
    to the name that is later called), with the ``if`` and ``x if c else y`` tests around it."""

    def __init__(self, release: Release) -> None:
        self.r = release

    def read(self, model_file: str, class_name: str) -> RouteCondition | None:
        rel = self._rel(model_file)
        mod = self.r.module(rel)
        if mod is None or not any(c.name == class_name for c in _classes(mod)):
            what = f"{rel} is absent or unreadable" if mod is None else f"no class {class_name} in {rel}"
            return RouteCondition("mla", f"undecided: {what}", None)
        reach = _Reach([], [], [])
        self._walk(rel, class_name, reach, set(), 0)
        return self._answer(class_name, reach)

    def _rel(self, model_file: str) -> str:
        p = Path(model_file)
        if p.is_absolute():
            try:
                return p.resolve().relative_to(self.r.root.resolve()).as_posix()
            except (ValueError, OSError):
                return model_file
        return p.as_posix()

    @staticmethod
    def _answer(class_name: str, reach: _Reach) -> RouteCondition | None:
        if reach.uses:
            first = reach.uses[0][0]
            if any(cond is None for _, cond in reach.uses):
                always = next(c for c, cond in reach.uses if cond is None)
                return RouteCondition("mla", "always", always)
            conds = list(dict.fromkeys(cond for _, cond in reach.uses if cond))
            return RouteCondition("mla", "when " + " or ".join(f"({c})" if " or " in c else c for c in conds), first)
        if reach.inner:
            return RouteCondition("mla", f"undecided: {class_name} builds its inner model by architecture name "
                                  f"({reach.inner[0].where}); that class's file decides", reach.inner[0])
        if reach.unfollowed:
            return RouteCondition("mla", f"undecided: no MLA attention in the files read; not followed: "
                                  f"{', '.join(reach.unfollowed)}", None)
        return None

    def _walk(self, rel: str, name: str, reach: _Reach, seen: set[tuple[str, str]], depth: int) -> None:
        if (rel, name) in seen:
            return
        seen.add((rel, name))
        mod = self.r.module(rel)
        if mod is None:
            reach.unfollowed.append(f"{name} ({rel} unreadable)")
            return
        classes = {c.name: c for c in _classes(mod)}
        imports = self._imports(rel, mod)
        todo, done = [name], set()
        while todo:
            cls = classes.get(todo.pop())
            if cls is None or cls.name in done:
                continue
            done.add(cls.name)
            self._uses_in(rel, mod, cls, classes, reach)
            for ref in {n.id for n in ast.walk(cls) if isinstance(n, ast.Name)} - done:
                if ref in classes:
                    todo.append(ref)
                elif ref in imports and not MLA_NAME.search(ref):
                    self._follow(imports[ref], ref, reach, seen, depth)

    def _follow(self, rel: str, name: str, reach: _Reach, seen: set[tuple[str, str]], depth: int) -> None:
        if depth + 1 >= MLA_DEPTH:
            reach.unfollowed.append(f"{name} ({rel})")
        else:
            self._walk(rel, name, reach, seen, depth + 1)

    def _imports(self, rel: str, mod: _Module) -> dict[str, str]:
        """Names imported from other model files (same folder, relative or absolute): name -> file."""
        folder = Path(rel).parent
        package = self.r.root.name
        out = {}
        for node in mod.tree.body:
            if not isinstance(node, ast.ImportFrom) or node.module is None:
                continue
            if node.level == 1:
                target = (folder / (node.module.replace(".", "/") + ".py")).as_posix()
            elif node.level == 0 and node.module.startswith(package + "."):
                target = node.module[len(package) + 1:].replace(".", "/") + ".py"
            else:
                continue
            if Path(target).parent == folder and (self.r.root / target).is_file():
                out.update({a.asname or a.name: target for a in node.names})
        return out

    def _uses_in(self, rel: str, mod: _Module, cls: ast.ClassDef, classes: dict[str, ast.ClassDef], reach: _Reach) -> None:
        if MLA_NAME.search(cls.name):
            return  # the attention class itself
        for node in ast.walk(cls):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in INNER_BUILDERS:
                reach.inner.append(self.r.cite(rel, node.lineno))
            if not (isinstance(node, ast.Name) and MLA_NAME.search(node.id) and _constructs(mod, node)):
                continue
            if node.id in classes or node.id[:1].isupper():
                fn = _enclosing(mod, node)
                reach.uses.append((self.r.cite(rel, node.lineno), _when(mod, node, fn or cls)))


def _constructs(mod: _Module, node: ast.Name) -> bool:
    """``node`` is called, or is the value (or a branch of the value) of an assignment."""
    parent = mod.parents.get(node)
    while isinstance(parent, ast.IfExp) and node is not parent.test:
        node, parent = parent, mod.parents.get(parent)  # type: ignore[assignment]
    if isinstance(parent, ast.Call):
        return parent.func is node
    return isinstance(parent, (ast.Assign, ast.AnnAssign)) and parent.value is node


def _when(mod: _Module, node: ast.AST, stop: ast.AST) -> str | None:
    """The ``if`` tests and conditional-expression tests enclosing ``node`` inside ``stop``."""
    tests: list[str] = []
    child, cur = node, mod.parents.get(node)
    while cur is not None and cur is not stop:
        if isinstance(cur, ast.IfExp) and child is not cur.test:
            text = ast.unparse(cur.test)
            tests.append(text if child is cur.body else f"not ({text})")
        child, cur = cur, mod.parents.get(cur)
    inner = " and ".join(reversed(tests))
    outer = _conditions(mod, node, stop)
    return " and ".join(t for t in (outer, inner) if t) or None


# == entry points ==================================================================================
def read_route_facts(engine: str, engine_root: Path | str | None = None) -> RouteFacts:
    """The native capture route and the plugin loader of ``engine``'s release at ``engine_root``
    (None: the installed engine). A root that is not an engine gives both unavailable, with why."""
    try:
        loc = locate_engine(engine, engine_root)
    except ProbeError as e:
        why = f"{engine}: {e}"
        kind, name = (("entry_points", "vllm.general_plugins") if engine == "vllm"
                      else ("env_package", "SGLANG_EXTERNAL_MODEL_PACKAGE"))
        return RouteFacts(NativeCapture(engine, "unknown", False, why),
                          PluginLoader(engine, "unknown", False, kind, name, None, why))
    return _read_cached(engine, str(loc.root), loc.version, _stamp(loc.root))


def _stamp(root: Path) -> float:
    """A change marker for the in-process cache: the package directory's mtime."""
    try:
        return root.stat().st_mtime
    except OSError:
        return 0.0


@functools.lru_cache(maxsize=32)
def _read_cached(engine: str, root: str, version: str, stamp: float) -> RouteFacts:
    release = Release(engine, Path(root), version)
    plugins = PluginReader(release)
    if engine == "vllm":
        return RouteFacts(VllmRoute(release).read(), plugins.vllm())
    return RouteFacts(SglangRoute(release).read(), plugins.sglang())


def clear_cache() -> None:
    _read_cached.cache_clear()


def uses_mla(engine: str, engine_root: Path | str | None, model_file: str, class_name: str) -> RouteCondition | None:
    """Whether ``class_name``'s attention is MLA, read from its model file (relative to the engine
    root, or absolute): ``"always"``, ``"when <conditions as read>"``, None when the classes it
    builds construct no MLA attention, ``"undecided: ..."`` where the files read do not say."""
    try:
        loc = locate_engine(engine, engine_root)
    except ProbeError as e:
        return RouteCondition("mla", f"undecided: {e}", None)
    return MlaReader(Release(engine, loc.root, loc.version)).read(model_file, class_name)


__all__ = ["read_route_facts", "uses_mla", "clear_cache", "Release", "MlaReader"]
