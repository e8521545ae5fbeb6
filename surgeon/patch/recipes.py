"""Recipes and the source reducer the rewriter and patch coverage share.

Recipes (``patches/*.yaml``, shipped in the wheel: :mod:`surgeon.core.data`) are data: per engine
and model file/class they override what the generic recogniser (:data:`GENERIC`) would pick. The
reducer (:func:`reduce_to_spans`, :func:`parse_reduced`, :func:`class_spans`) empties every line libcst need not parse (the
top-level imports and the classes concerned are kept, line numbers unchanged), so that
``surgeon apply`` and ``surgeon coverage`` read the same module quickly. Both live here, below the
rewriter, the planner and coverage, so that none of those imports another sideways.
"""

from __future__ import annotations

import ast
import codecs
import io
import re
import tokenize
from collections.abc import Sequence
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Literal

import libcst as cst
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from surgeon.core.data import data_dir
from surgeon.core.errors import BadInput, InternalError
from surgeon.engines.source.anatomy import ast_span, loops_over_ast

__all__ = [
    "GENERIC",
    "PatchApplicationError",
    "Recipe",
    "class_spans",
    "find_recipe",
    "load_recipes",
    "parse",
    "parse_reduced",
    "reduce_to_spans",
    "safe_expression",
]

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

class PatchApplicationError(BadInput):
    """The rewriter refuses to patch: ``relpath`` and ``anchor`` say where, ``reason`` why
    (a BadInput: the CLI reports it as one line, exit 2)."""

    def __init__(self, relpath: str, anchor: str, reason: str, at: tuple[int, int] | None = None):
        self.relpath, self.anchor, self.reason = relpath, anchor, reason
        where = f"{relpath}:{at[0]}:{at[1]}" if at is not None else relpath  # line:column where there is one
        super().__init__(f"{where}: {anchor}: {reason}")


# ---------------------------------------------------------------------------------------------
# Recipes
# ---------------------------------------------------------------------------------------------
_SAFE_EXPR_NODES = (
    cst.Name, cst.Attribute, cst.Subscript, cst.SubscriptElement, cst.Index, cst.Integer,
    cst.UnaryOperation, cst.Minus, cst.Dot, cst.LeftSquareBracket, cst.RightSquareBracket,
)


def safe_expression(text: str) -> cst.BaseExpression:
    """Parse a recipe expression; only names, attributes, subscripts and integers."""
    try:
        expr = cst.parse_expression(text)
    except cst.ParserSyntaxError as exc:
        raise ValueError(f"not a Python expression: {text!r}") from exc

    class _Check(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if not isinstance(node, _SAFE_EXPR_NODES) and not isinstance(
                node, (cst.SimpleWhitespace, cst.ParenthesizedWhitespace, cst.LeftParen, cst.RightParen, cst.Comma)
            ):
                raise ValueError(
                    f"recipe expression {text!r} may use only names, attributes, subscripts and "
                    f"integers (found {type(node).__name__})"
                )
            return True

    expr.visit(_Check())
    return expr


class Recipe(BaseModel):
    """Where the decoder loop is and how to read the stream, for one engine model file/class.

    Fields left ``None`` fall back to the generic recognizer."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field(min_length=1)
    engine: Literal["sglang", "vllm"] | None = None
    file: str | None = Field(
        default=None, description="model file relative to the engine package, e.g. srt/models/llama.py; None: any file"
    )
    class_name: str | None = Field(default=None, description="decoder model class; None: any class")
    method: str = Field(default="forward", description="method holding the decoder-layer loop")
    layers_attr: str = Field(default="layers", description="attribute of self holding the decoder layers")
    index: str | None = Field(
        default=None, description="global layer index expression inside the loop; None: the loop variable"
    )
    residual: str | None = Field(
        default=None,
        description="expression of the separately carried residual; 'none': the layer returns the sum; None: auto",
    )
    num_tokens: str | None = Field(
        default=None,
        description="expression for begin_step's token count; None: positions.shape[-1] or input_ids.shape[0]",
    )
    final_norm: list[str] = Field(
        default_factory=lambda: ["norm", "final_layernorm", "ln_f", "final_norm", "norm_f", "model_norm"],
        description="attributes of self that are the final norm; "
                    "the final-norm anchor is the one assignment after the loop that uses one",
    )
    refuse: str | None = Field(default=None, description="always refuse, with this reason")
    notes: str | None = None

    @field_validator("layers_attr", "method")
    @classmethod
    def _ident(cls, v: str) -> str:
        if not _IDENT.fullmatch(v):
            raise ValueError(f"not an identifier: {v!r}")
        return v

    @field_validator("final_norm")
    @classmethod
    def _idents(cls, v: list[str]) -> list[str]:
        for name in v:
            if not _IDENT.fullmatch(name):
                raise ValueError(f"not an identifier: {name!r}")
        return v

    @field_validator("index", "num_tokens")
    @classmethod
    def _expr(cls, v: str | None) -> str | None:
        if v is not None:
            safe_expression(v)
        return v

    @field_validator("residual")
    @classmethod
    def _residual(cls, v: str | None) -> str | None:
        if v is not None and v != "none":
            safe_expression(v)
        return v

    def matches(self, engine: str | None, relpath: str, class_name: str | None) -> bool:
        if self.engine is not None and engine is not None and self.engine != engine:
            return False
        if self.file is not None and not (relpath == self.file or relpath.endswith("/" + self.file)):
            return False
        if self.class_name is not None and class_name is not None and self.class_name != class_name:
            return False
        return True


GENERIC = Recipe(name="generic")


def load_recipes(directory: Path | str | Traversable | None = None) -> list[Recipe]:
    """Every ``*.yaml`` recipe in ``directory`` (each file: one mapping or a list of mappings);
    None: the recipes surgeon ships (:func:`surgeon.core.data.data_dir`). No recipe at all is an
    error naming the folder: ValueError for a folder the caller chose, InternalError for the
    shipped one (an install without its recipes would patch fewer classes, silently)."""
    folder = data_dir("patches") if directory is None else directory
    if isinstance(folder, str):
        folder = Path(folder)
    recipes: list[Recipe] = []
    found = sorted((f for f in folder.iterdir() if f.name.endswith(".yaml") and f.is_file()), key=lambda f: f.name)
    for path in found:
        data = _recipe_yaml(path)
        items = data if isinstance(data, list) else [data]
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise ValueError(f"{path}: recipe {i} is not a mapping")
            try:
                recipes.append(Recipe.model_validate(item))
            except ValidationError as exc:
                raise ValueError(f"{path}: recipe {i}: {exc}") from exc
    if not recipes:
        if directory is None:
            raise InternalError(f"no patch recipes (*.yaml) in {folder}: the install is incomplete; reinstall surgeon")
        raise ValueError(f"no patch recipes (*.yaml) in {folder}")
    return recipes


def _recipe_yaml(path: Path | Traversable) -> object:
    """A recipe file's YAML; one that is not YAML is a ValueError located at its line and column."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ValueError(f"{at}: not YAML: {getattr(exc, 'problem', None) or exc}") from None


def find_recipe(recipes: Sequence[Recipe], *, engine: str | None, relpath: str,
                class_name: str | None) -> Recipe:
    """The most specific matching recipe (file and class named beat file only), else GENERIC."""
    best: tuple[int, Recipe] | None = None
    for r in recipes:
        if not r.matches(engine, relpath, class_name):
            continue
        score = (r.file is not None) * 2 + (r.class_name is not None) + (r.engine is not None)
        if best is None or score > best[0]:
            best = (score, r)
    return best[1] if best else GENERIC


def parse(source_bytes: bytes, relpath: str) -> cst.Module:
    """libcst module of ``source_bytes`` (PatchApplicationError, one line located at its line and
    column, when it is not text in its encoding or does not parse)."""
    bad = _undecodable(source_bytes)
    if bad is not None:
        line, column, why = bad
        raise PatchApplicationError(relpath, "module", why, at=(line, column))
    try:
        return cst.parse_module(source_bytes)
    except cst.ParserSyntaxError as exc:
        at, message = (exc.editor_line, exc.editor_column), (exc.message.strip().splitlines() or ["syntax error"])[0]
    try:  # Python's own parser places the error where a reader looks for it (libcst: where it gave up)
        ast.parse(source_bytes)
    except SyntaxError as exc:
        at, message = (exc.lineno or at[0], exc.offset or 1), exc.msg
    raise PatchApplicationError(relpath, "module", f"does not parse: {message}", at=at)


def _undecodable(source: bytes) -> tuple[int, int, str] | None:
    """(line, column, why) of the first thing that keeps ``source`` from being Python text (an
    encoding cookie Python does not know, a byte that is not text in the file's encoding: UTF-8 but
    where a cookie says otherwise); None when it decodes. The column counts bytes from 1."""
    try:
        encoding = tokenize.detect_encoding(io.BytesIO(source).readline)[0]
    except SyntaxError as exc:  # an unknown cookie, or first lines that are not UTF-8
        return _bad_byte(source, "utf-8") or (1, 1, f"not Python source text: {exc.msg}")
    try:
        return _bad_byte(source, encoding)
    except LookupError:  # detect_encoding checks the cookie's codec: not reached, said all the same
        return 1, 1, f"not Python source text: unknown encoding {encoding}"


def _bad_byte(source: bytes, encoding: str) -> tuple[int, int, str] | None:
    try:
        source.decode(encoding)
    except UnicodeDecodeError as exc:
        start = source.rfind(b"\n", 0, exc.start) + 1
        byte = source[exc.start:exc.start + 1].hex()
        return source.count(b"\n", 0, exc.start) + 1, exc.start - start + 1, f"not {encoding} text (byte 0x{byte})"
    return None


_CODING = re.compile(rb"^[ \t\f]*#.*?coding[:=]")


def _first_indent(source: bytes) -> tuple[int, str] | None:
    """Line and text of the first INDENT token (libcst takes it as the module's default_indent,
    and stores a block's indent only where it differs); None when there is none or the tokenizer
    stops."""
    try:
        for tok in tokenize.tokenize(io.BytesIO(source).readline):
            if tok.type == tokenize.INDENT:
                return tok.start[0], tok.string
    except (tokenize.TokenError, SyntaxError):
        return None
    return None


def class_spans(source: bytes, class_name: str | None, recipe: Recipe) -> list[tuple[int, int]] | None:
    """Line spans of the top-level imports and the class(es) the rewrite can touch (what
    :func:`reduce_to_spans` keeps); None where there is no class to keep or the stdlib parser
    fails (then the whole file is parsed)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    spans = [ast_span(st) for st in tree.body if isinstance(st, (ast.Import, ast.ImportFrom))]
    kept = 0
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        if class_name is not None:
            keep = cls.name == class_name
        else:
            keep = any(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == recipe.method
                       and loops_over_ast(f, recipe.layers_attr) for f in cls.body)
        if keep:
            spans.append(ast_span(cls))
            kept += 1
    return spans if kept else None


def reduce_to_spans(source: bytes, spans: list[tuple[int, int]]) -> tuple[bytes, str] | None:
    """``source`` with every line outside ``spans`` (1-based, inclusive line ranges) emptied, its
    line ending kept: the same line numbers, far less for libcst to parse, and the same default
    indent (the first indented block, which libcst reads it from, is kept, or stood in for by
    ``if 1:`` / ``<indent>pass`` on its two emptied lines); an encoding cookie is kept. Returns the
    bytes and that indent; None where that is not exact: a BOM, or the tokenizer fails (then
    the whole file is to be parsed). Shared by ``rewrite`` and ``surgeon coverage``."""
    if source.startswith(codecs.BOM_UTF8):
        return None
    # an encoding cookie (a comment line among the first two) is kept: libcst reads it
    cookies = [i for i, x in enumerate(source.split(b"\n", 2)[:2], 1) if _CODING.match(x)]
    first = _first_indent(source)
    if first is None:
        return None
    lines = source.splitlines(keepends=True)
    keep_line = bytearray(len(lines) + 2)
    for a, b in spans:
        keep_line[a:b + 1] = b"\x01" * (b + 1 - a)
    for i in cookies:
        keep_line[i] = 1
    out = [line if keep_line[i] else line[len(line.rstrip(b"\r\n")):] for i, line in enumerate(lines, 1)]
    at, indent = first
    if not keep_line[at]:
        # the block is in an emptied top-level statement (so is the line before it): every kept
        # line before it is a whole statement without a block
        if at < 2 or keep_line[at - 1]:
            return None
        out[at - 2] = b"if 1:" + out[at - 2]
        out[at - 1] = indent.encode() + b"pass" + out[at - 1]
    return b"".join(out), indent


def parse_reduced(source: bytes, spans: list[tuple[int, int]] | None) -> tuple[cst.Module, bytes] | None:
    """libcst module of ``source`` reduced to ``spans`` and the reduced bytes, or None where the
    reduction is not exact or does not parse as the whole file would (then parse the whole)."""
    reduced = reduce_to_spans(source, spans) if spans is not None else None
    if reduced is None or _undecodable(source) is not None:  # the whole file's parse says where
        return None
    text, indent = reduced
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError:
        return None
    return (module, text) if module.default_indent == indent else None

