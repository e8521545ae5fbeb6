"""An engine's source as the probe reads it, in three tiers of cost.

1. Text (every model file): read once, hashed for the cache, and pre-filtered with a regular
   expression over class headers, so only files that can matter go further. Every read goes
   through :func:`read_source` (:mod:`surgeon.core.safefile`): a FIFO, device, directory or
   over-large file named ``*.py`` is refused at once (kept in :attr:`SourceIndex.refused` with the
   reason), never waited on or read into memory.
2. :mod:`ast` (the files that matter, and whatever their imports lead to): classes, bases,
   imports and each function's line range. Cheap, and enough to resolve names and inheritance
   across files.
3. :mod:`libcst` (only the functions the analysis actually reads): a method's lines are parsed on
   their own, and :class:`~libcst.metadata.PositionProvider` lines are shifted back to the file's.
   libcst is ~15x slower than ast, so parsing whole files would make a full probe take tens of
   seconds; parsing functions keeps it to a few.

Nothing here imports engine code.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TypeVar

import libcst as cst
import libcst.matchers as m
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from surgeon.engines.source.cstwalk import StatementLines
from surgeon.engines.source.reading import SOURCE_ERRORS, read_source

ClassKey = tuple[str, str]  # (path relative to the package dir, class name)

_CLASS_HEADER = re.compile(r"^class[ \t]+(\w+)[ \t]*(?:\(((?:[^()]|\((?:[^()]|\([^()]*\))*\))*)\))?[ \t]*:", re.M)
_WORD = re.compile(r"[A-Za-z_]\w*")
_Node = TypeVar("_Node", bound=cst.CSTNode)


def key_str(key: ClassKey) -> str:
    return f"{key[0]}:{key[1]}"


@dataclass
class FuncInfo:
    """A function defined in a class body (ast level)."""

    name: str
    start: int  # first line, decorators included
    end: int
    line: int  # the ``def`` line
    decorators: tuple[str, ...]
    node: ast.FunctionDef | ast.AsyncFunctionDef

    @property
    def is_property(self) -> bool:
        return any(d in ("property", "cached_property", "functools.cached_property") for d in self.decorators)


@dataclass
class ClassInfo:
    path: str
    name: str
    line: int  # the ``class`` line
    start: int
    end: int
    base_nodes: list[ast.expr]
    functions: dict[str, FuncInfo]
    class_assigns: dict[str, ast.expr]

    @property
    def key(self) -> ClassKey:
        return (self.path, self.name)

    @property
    def base_texts(self) -> list[str]:
        return [ast.unparse(b) for b in self.base_nodes]


@dataclass
class ModuleInfo:
    path: str
    dotted: str
    text: str
    tree: ast.Module
    classes: dict[str, ClassInfo] = field(default_factory=dict)
    # local name -> (absolute dotted module, imported attribute or None for ``import x``)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    assigns: dict[str, ast.expr] = field(default_factory=dict)

    @cached_property
    def lines(self) -> list[str]:
        return self.text.splitlines(keepends=True)

    def segment(self, node: ast.AST) -> str:
        return source_segment(self.lines, node)


def source_segment(lines: list[str], node: ast.AST) -> str:
    """The source text of ``node`` from the file's lines (kept ends): what
    ``ast.get_source_segment`` gives, without splitting the whole file on every call (which made
    it the probe's costliest call on large model files)."""
    start, end = getattr(node, "lineno", None), getattr(node, "end_lineno", None)
    col, end_col = getattr(node, "col_offset", None), getattr(node, "end_col_offset", None)
    if start is None or end is None or col is None or end_col is None or end > len(lines):
        return ast.unparse(node)
    chunk = [ln.encode("utf-8") for ln in lines[start - 1:end]]  # offsets are UTF-8 bytes
    if start == end:
        return chunk[0][col:end_col].decode("utf-8", "replace")
    chunk[0] = chunk[0][col:]
    chunk[-1] = chunk[-1][:end_col]
    return b"".join(chunk).decode("utf-8", "replace")


_FIELDS: dict[type, tuple[str, ...]] = {}
_TRIVIA = (cst.BaseParenthesizableWhitespace, cst.EmptyLine, cst.TrailingWhitespace, cst.Newline, cst.Comment,
           cst.LeftParen, cst.RightParen, cst.Comma, cst.LeftSquareBracket, cst.RightSquareBracket, cst.Dot,
           cst.Colon, cst.Semicolon, cst.AssignEqual)


# per concrete type: 2 a node to index, 1 trivia (whitespace, punctuation), 0 not a node. libcst's
# node bases are ABCs, whose isinstance checks made this walk the probe's costliest loop.
_KIND: dict[type, int] = {tuple: 3, list: 3}


def _kind(t: type) -> int:
    k = _KIND.get(t)
    if k is None:
        k = _KIND[t] = (1 if issubclass(t, _TRIVIA) else 2) if issubclass(t, cst.CSTNode) else 0
    return k


def _child_nodes(node: cst.CSTNode) -> list[cst.CSTNode]:
    names = _FIELDS.get(type(node))
    if names is None:
        names = _FIELDS[type(node)] = tuple(f.name for f in dataclasses.fields(node))
    out: list[cst.CSTNode] = []
    for name in names:
        v = getattr(node, name)
        k = _KIND.get(type(v)) or _kind(type(v))
        if k == 2:
            out.append(v)
        elif k == 3:
            out.extend(x for x in v if (_KIND.get(type(x)) or _kind(type(x))) == 2)
    return out


class CstFunction:
    """One function parsed with libcst.

    Queries go through a flat index of the tree built in one pass (pre-order numbers, subtree
    ends, parents, nodes by type): libcst's own ``matchers.findall`` walks the tree with its
    visitor machinery on every call, which made a full probe ten times slower. Line numbers come
    from :class:`StatementLines`: the statements' lines from the file's ``ast`` (which the index has
    parsed anyway) and, for a node inside a statement, libcst's position codegen of that statement
    alone; libcst's :class:`~libcst.metadata.PositionProvider` over the whole function (the same
    answers, ten times the cost) only where the two trees do not line up.
    """

    def __init__(self, owner: ClassKey, path: str, name: str, module: cst.Module, node: cst.FunctionDef, offset: int,
                 ast_node: ast.FunctionDef | ast.AsyncFunctionDef | None = None) -> None:
        self.owner = owner
        self.path = path  # module the function lives in (for name resolution)
        self.name = name
        self.module = module
        self.node = node
        self.offset = offset  # add to a snippet line to get the file's line
        self.ast_node = ast_node
        self._positions: dict | None = None
        self._lines: StatementLines | None = None
        self._order: dict[cst.CSTNode, int] = {}
        self._end: dict[cst.CSTNode, int] = {}
        self._parent: dict[cst.CSTNode, cst.CSTNode] = {}
        self._by_type: dict[type, list[cst.CSTNode]] = {}
        self._all: list[cst.CSTNode] = []
        self._build()

    def _build(self) -> None:
        stack: list[tuple[cst.CSTNode, bool]] = [(self.node, False)]
        while stack:
            node, done = stack.pop()
            if done:
                self._end[node] = len(self._all) - 1
                continue
            self._order[node] = len(self._all)
            self._all.append(node)
            self._by_type.setdefault(type(node), []).append(node)
            stack.append((node, True))
            children = _child_nodes(node)
            for child in reversed(children):
                self._parent[child] = node
                stack.append((child, False))

    # -- structure ---------------------------------------------------------------------------
    def order(self, node: cst.CSTNode) -> int:
        return self._order.get(node, -1)

    def end(self, node: cst.CSTNode) -> int:
        return self._end.get(node, -1)

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self._parent.get(node)

    def ancestors(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        while node in self._parent:
            node = self._parent[node]
            yield node

    def inside(self, node: cst.CSTNode, container: cst.CSTNode) -> bool:
        i = self._order.get(node, -1)
        return self._order.get(container, -2) < i <= self._end.get(container, -2) if i >= 0 else False

    def findall(self, matcher: m.BaseMatcherNode, within: cst.CSTNode | None = None) -> list[cst.CSTNode]:
        """Nodes matching ``matcher`` (in source order), optionally inside ``within``."""
        node_type = getattr(cst, type(matcher).__name__, None)
        if isinstance(node_type, type) and issubclass(node_type, cst.CSTNode):
            pool = self._by_type.get(node_type, [])
        else:
            pool = self._all
        if within is not None:
            lo, hi = self._order.get(within, 0), self._end.get(within, -1)
            pool = [n for n in pool if lo <= self._order[n] <= hi]
        return [n for n in pool if m.matches(n, matcher)]

    def findall_of(self, kind: type[_Node], matcher: m.BaseMatcherNode,
                   within: cst.CSTNode | None = None) -> list[_Node]:
        """:meth:`findall` typed as the node class ``kind`` that ``matcher`` matches (``m.Call``:
        ``cst.Call``), so callers read the matched node's fields with the type checker's help
        instead of ignoring it. Nodes of another class are dropped, which a matcher of ``kind``
        never yields anyway."""
        return [n for n in self.findall(matcher, within) if isinstance(n, kind)]

    # -- lines -------------------------------------------------------------------------------
    def _pos(self, node: cst.CSTNode) -> CodeRange | None:
        """libcst's position of ``node`` in the snippet (the slow, always-right path)."""
        if self._positions is None:
            self._positions = dict(MetadataWrapper(self.module, unsafe_skip_copy=True).resolve(PositionProvider))
        return self._positions.get(node)

    def _span(self, node: cst.CSTNode) -> tuple[int, int] | None:
        """(first, last) file line of ``node``; None: not a node of this function."""
        if node not in self._order:
            return None
        if self._lines is None and self.ast_node is not None:
            self._lines = StatementLines(self._all, self._parent, self.ast_node)
        span = self._lines.span(node) if self._lines is not None and self._lines.ok else None
        if span is None:
            pos = self._pos(node)
            span = (pos.start.line + self.offset, pos.end.line + self.offset) if pos is not None else None
        return span

    def line(self, node: cst.CSTNode) -> int:
        span = self._span(node)
        return span[0] if span is not None else 0

    def end_line(self, node: cst.CSTNode) -> int:
        span = self._span(node)
        return span[1] if span is not None else 0

    @property
    def label(self) -> str:
        return f"{self.owner[0]}:{self.owner[1]}.{self.name}"


_EMPTY_MODULE = cst.Module(body=[])


def code(node: cst.CSTNode) -> str:
    """Source text of a libcst node, on one line."""
    return " ".join(_EMPTY_MODULE.code_for_node(node).split())


class SourceIndex:
    """The files under an engine package directory, read lazily and never imported."""

    def __init__(self, package_dir: Path, package: str, models_dir: str | Sequence[str]) -> None:
        self.package_dir = package_dir
        self.package = package
        dirs = (models_dir,) if isinstance(models_dir, str) else tuple(models_dir)
        # every models directory of the release (vLLM 0.33: ``model_executor/models`` and the
        # per-platform ``models/<family>/<platform>/`` tree); the first is the classic one
        self.models_dirs = tuple(d.strip("/") for d in dirs)
        self.models_dir = self.models_dirs[0]
        self._texts: dict[str, str | None] = {}
        #: files that exist but cannot be read (a FIFO, a device, too large, no permission): why
        self.refused: dict[str, str] = {}
        self._modules: dict[str, ModuleInfo | None] = {}
        self._functions: dict[tuple[ClassKey, str], CstFunction | None] = {}
        self._exprs: dict[tuple[str, int, int], cst.BaseExpression | None] = {}
        self._mro: dict[ClassKey, list[ClassKey]] = {}
        self.lines_parsed_cst = 0
        self._prefiltered: dict[tuple[str, ...], tuple[list[str], set[str]]] = {}
        # results that depend on the source only, shared by every analysis of this index
        self.memo: dict[str, dict] = {}

    # -- tier 1: text ------------------------------------------------------------------------
    @cached_property
    def model_files(self) -> list[str]:
        files: set[Path] = set()
        for d in self.models_dirs:
            base = self.package_dir / d
            if base.is_dir():
                files.update(p for p in base.rglob("*.py") if "__pycache__" not in p.parts)
        return sorted(p.relative_to(self.package_dir).as_posix() for p in files)

    def text(self, path: str) -> str | None:
        if path not in self._texts:
            self._texts[path] = None
            try:
                self._texts[path] = read_source(self.package_dir / path)
            except FileNotFoundError:
                pass
            except SOURCE_ERRORS as e:
                self.refused[path] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return self._texts[path]

    def read_paths(self) -> list[str]:
        """Every file read so far (relative paths), model files or not."""
        return sorted(p for p, t in self._texts.items() if t is not None)

    def fingerprint(self, paths: Iterable[str]) -> str:
        """A content hash of ``paths`` (for the cache key)."""
        h = hashlib.sha256()
        for p in sorted(paths):
            h.update(p.encode())
            h.update(b"\0")
            h.update((self.text(p) or "").encode("utf-8", "surrogatepass"))
            h.update(b"\0unreadable\0" if p in self.refused else b"\0")
        return h.hexdigest()

    def prefilter(self, triggers: Iterable[str]) -> tuple[list[str], set[str]]:
        """Files that may hold relevant classes, and the names of those classes: a class is a seed
        when a trigger appears between its header and the next class header, and relevant when it
        is a seed or (transitively) names a relevant class among its bases. Regular expressions
        over the text, no parsing: a cheap superset for the ast tier to decide precisely."""
        triggers = tuple(triggers)
        if triggers in self._prefiltered:
            return self._prefiltered[triggers]
        self._prefiltered[triggers] = found_files = self._prefilter(triggers)
        return found_files

    def _prefilter(self, triggers: tuple[str, ...]) -> tuple[list[str], set[str]]:
        headers: dict[str, list[tuple[str, set[str]]]] = {}
        names: set[str] = set()
        for path in self.model_files:
            text = self.text(path) or ""
            if "class " not in text:
                continue
            found = list(_CLASS_HEADER.finditer(text))
            headers[path] = [(mt.group(1), set(_WORD.findall(mt.group(2) or ""))) for mt in found]
            if not any(t in text for t in triggers):
                continue
            for i, mt in enumerate(found):
                body = text[mt.start(): found[i + 1].start() if i + 1 < len(found) else len(text)]
                if any(t in body for t in triggers):
                    names.add(mt.group(1))
        changed = True
        while changed:
            changed = False
            for classes in headers.values():
                for name, bases in classes:
                    if name not in names and bases & names:
                        names.add(name)
                        changed = True
        files = [p for p in self.model_files if any(name in names for name, _ in headers.get(p, ()))]
        return files, names

    # -- tier 2: ast -------------------------------------------------------------------------
    def dotted_of(self, path: str) -> str:
        parts = path[: -len(".py")].split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        return ".".join([self.package, *parts])

    def path_of(self, dotted: str) -> str | None:
        """The package-relative file of an absolute dotted module name inside the models directory.
        Modules elsewhere (layers, utilities) are treated as external: model classes, their bases
        and their capture setters live in the models directory, and parsing the rest would only
        cost time."""
        if dotted != self.package and not dotted.startswith(self.package + "."):
            return None
        rel = dotted.split(".")[1:]
        for cand in ("/".join(rel) + ".py", "/".join([*rel, "__init__.py"])):
            cand = cand.strip("/")
            if any(cand.startswith(d + "/") for d in self.models_dirs) and self.text(cand) is not None:
                return cand
        return None

    def parsed(self, path: str) -> ModuleInfo | None:
        """The module if it has been parsed already (None otherwise: nothing is parsed here)."""
        return self._modules.get(path)

    def module(self, path: str) -> ModuleInfo | None:
        if path in self._modules:
            return self._modules[path]
        text = self.text(path)
        info: ModuleInfo | None = None
        if text is not None:
            try:
                tree = ast.parse(text)
            except (SyntaxError, ValueError):
                tree = None
            if tree is not None:
                info = ModuleInfo(path=path, dotted=self.dotted_of(path), text=text, tree=tree)
                self._index_module(info)
        self._modules[path] = info
        return info

    def _index_module(self, info: ModuleInfo) -> None:
        package_parts = info.dotted.split(".")
        if not info.path.endswith("__init__.py"):
            package_parts = package_parts[:-1]
        for node in _top_level(info.tree.body):
            if isinstance(node, ast.ClassDef):
                info.classes[node.name] = self._class_info(info.path, node)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package_parts[: len(package_parts) - (node.level - 1)]
                    module = ".".join([*base, *(node.module.split(".") if node.module else [])])
                else:
                    module = node.module or ""
                for alias in node.names:
                    if alias.name != "*":
                        info.imports[alias.asname or alias.name] = (module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        info.imports[alias.asname] = (alias.name, None)
                    else:
                        info.imports[alias.name.split(".")[0]] = (alias.name.split(".")[0], None)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        info.assigns[t.id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                info.assigns[node.target.id] = node.value

    @staticmethod
    def _class_info(path: str, node: ast.ClassDef) -> ClassInfo:
        functions: dict[str, FuncInfo] = {}
        assigns: dict[str, ast.expr] = {}
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = tuple(ast.unparse(d).split("(")[0] for d in item.decorator_list)
                start = min([item.lineno, *(d.lineno for d in item.decorator_list)])
                functions[item.name] = FuncInfo(item.name, start, item.end_lineno or item.lineno, item.lineno, decorators, item)
            elif isinstance(item, ast.Assign):
                for t in item.targets:
                    if isinstance(t, ast.Name):
                        assigns[t.id] = item.value
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                assigns[item.target.id] = item.value
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        end = node.end_lineno or node.lineno
        return ClassInfo(path, node.name, node.lineno, start, end, list(node.bases), functions, assigns)

    def class_info(self, key: ClassKey) -> ClassInfo | None:
        mod = self.module(key[0])
        return mod.classes.get(key[1]) if mod else None

    def classes_in(self, paths: Iterable[str]) -> Iterator[ClassInfo]:
        for p in paths:
            mod = self.module(p)
            if mod:
                yield from mod.classes.values()

    def resolve(self, path: str, name: str, _seen: frozenset = frozenset()) -> ClassKey | str | None:
        """What ``name`` means at the top level of ``path``: a class key, a module path (str) for a
        module imported from inside the package, or None (external, unknown)."""
        if (path, name) in _seen:
            return None
        seen = _seen | {(path, name)}
        mod = self.module(path)
        if mod is None:
            return None
        if name in mod.classes:
            return (path, name)
        if name in mod.imports:
            dotted, attr = mod.imports[name]
            if attr is None:
                return self.path_of(dotted)
            target = self.path_of(dotted)
            if target is not None:
                found = self.resolve(target, attr, seen)
                if found is not None:
                    return found
            return self.path_of(f"{dotted}.{attr}")  # ``from pkg import submodule``
        if name in mod.assigns:
            value = mod.assigns[name]
            if isinstance(value, (ast.Name, ast.Attribute)):
                return self.resolve_expr(path, value, seen)
        return None

    def resolve_expr(self, path: str, node: ast.expr, _seen: frozenset = frozenset()) -> ClassKey | str | None:
        if isinstance(node, ast.Name):
            return self.resolve(path, node.id, _seen)
        if isinstance(node, ast.Attribute):
            base = self.resolve_expr(path, node.value, _seen)
            if isinstance(base, str):
                return self.resolve(base, node.attr, _seen)
            return None
        if isinstance(node, ast.Subscript):  # Generic[T]
            return self.resolve_expr(path, node.value, _seen)
        return None

    def bases(self, key: ClassKey) -> list[ClassKey]:
        info = self.class_info(key)
        if info is None:
            return []
        out = []
        for b in info.base_nodes:
            r = self.resolve_expr(key[0], b)
            if isinstance(r, tuple):
                out.append(r)
        return out

    def mro(self, key: ClassKey) -> list[ClassKey]:
        """Classes of the package in method-resolution order (C3 linearisation; bases outside the
        package, such as ``nn.Module``, are left out)."""
        if key in self._mro:
            return self._mro[key]
        self._mro[key] = [key]  # cycle guard
        seqs = [list(self.mro(b)) for b in self.bases(key)] + [self.bases(key)]
        result = [key]
        while True:
            seqs = [s for s in seqs if s]
            if not seqs:
                break
            for s in seqs:
                head = s[0]
                if not any(head in t[1:] for t in seqs):
                    break
            else:  # inconsistent hierarchy: fall back to depth-first order
                head = seqs[0][0]
            result.append(head)
            for s in seqs:
                if s and s[0] == head:
                    del s[0]
        self._mro[key] = result
        return result

    def find_function(self, key: ClassKey, name: str, after: ClassKey | None = None) -> tuple[ClassKey, FuncInfo] | None:
        """The first definition of method ``name`` along the MRO of ``key`` (after ``after``)."""
        order = self.mro(key)
        if after is not None and after in order:
            order = order[order.index(after) + 1 :]
        for k in order:
            info = self.class_info(k)
            if info and name in info.functions:
                return k, info.functions[name]
        return None

    def find_class_assign(self, key: ClassKey, name: str) -> tuple[ClassKey, ast.expr] | None:
        for k in self.mro(key):
            info = self.class_info(k)
            if info and name in info.class_assigns:
                return k, info.class_assigns[name]
        return None

    # -- tier 3: libcst ----------------------------------------------------------------------
    def function(self, owner: ClassKey, name: str) -> CstFunction | None:
        """Method ``name`` of class ``owner`` (defined in its own body), parsed with libcst."""
        cache_key = (owner, name)
        if cache_key in self._functions:
            return self._functions[cache_key]
        result: CstFunction | None = None
        info = self.class_info(owner)
        mod = self.module(owner[0])
        if info is not None and mod is not None and name in info.functions:
            fi = info.functions[name]
            body = "".join(mod.lines[fi.start - 1 : fi.end])
            # A dummy class hosts the indented method: snippet line 2 is file line ``fi.start``.
            source = "class _:\n" + body
            try:
                module = cst.parse_module(source)
                klass = module.body[-1]
                assert isinstance(klass, cst.ClassDef)
                fdef = klass.body.body[0]
                if isinstance(fdef, cst.FunctionDef):
                    result = CstFunction(owner, owner[0], name, module, fdef, fi.start - 2, fi.node)
                    self.lines_parsed_cst += fi.end - fi.start + 1
            except (cst.ParserSyntaxError, AssertionError, IndexError):
                result = None
        self._functions[cache_key] = result
        return result

    def expression(self, path: str, node: ast.expr) -> cst.BaseExpression | None:
        """A class- or module-level expression (``model_cls = DeepseekV2Model``) in libcst."""
        cache_key = (path, node.lineno, node.col_offset)
        if cache_key not in self._exprs:
            mod = self.module(path)
            result = None
            if mod is not None:
                try:
                    result = cst.parse_expression("(" + mod.segment(node) + ")")
                    self.lines_parsed_cst += (node.end_lineno or node.lineno) - node.lineno + 1
                except cst.ParserSyntaxError:
                    result = None
            self._exprs[cache_key] = result
        return self._exprs[cache_key]

    def function_text(self, key: ClassKey, fi: FuncInfo) -> str:
        mod = self.module(key[0])
        return "".join(mod.lines[fi.start - 1 : fi.end]) if mod else ""


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module statements, looking into top-level ``if``/``try`` blocks (TYPE_CHECKING, fallbacks)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body)
            for h in node.handlers:
                yield from _top_level(h.body)
            yield from _top_level(node.orelse)
            yield from _top_level(node.finalbody)
        else:
            yield node
