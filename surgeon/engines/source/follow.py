"""Capture sites outside the model file: a decoder layer that hands the capture collector to a
helper object built from another engine module (SGLang's
``self.layer_communicator.prepare_attn_and_capture_last_layer_outputs(..., captured_last_layer_outputs=...)``
in ``srt/layers/communicator.py``) is followed through its imports and the helper's body is read.

What is read, in the helper method that receives the collector:

* the ``<collector>.append(value)`` guarded by a test on the collector;
* where ``value`` comes from, through the method's local assignments (a gather or ``.clone()``
  of a name keeps that name's value): it must come from the residual alone, rebound before the
  append by ``hidden_states, residual = self.<m>(hidden_states, residual, ...)``;
* that method ``<m>``: every assignment to the residual there is either ``residual =
  hidden_states`` under ``residual is None`` (the first layer: the embedding) or the second
  output of a two-argument norm ``hidden_states, residual = <norm>(hidden_states, residual)``,
  the fused add-RMSNorm whose second output is the updated stream ``hidden + residual``.

Then the helper captures the residual stream at the layer entry, and evaluates at layer 0. Where
any step does not hold, :class:`Followed` says which, with file:line, and the answer is
unverified. Nothing is imported; files are read with :mod:`ast` through the source index.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from surgeon.core.idrules import CapturedValue
from surgeon.engines.source.index import ClassKey, SourceIndex


@dataclass(frozen=True)
class Followed:
    """What a helper outside the model file does with the capture collector."""

    value: CapturedValue
    how: str  # what was read, with file:line
    verified: bool
    reason: str | None = None  # why not verified


def package_path(index: SourceIndex, dotted: str) -> str | None:
    """The package-relative file of an absolute dotted module anywhere in the engine package (the
    source index resolves names only inside its models directory)."""
    if dotted != index.package and not dotted.startswith(index.package + "."):
        return None
    rel = dotted.split(".")[1:]
    for cand in ("/".join(rel) + ".py", "/".join([*rel, "__init__.py"])):
        if index.text(cand.strip("/")) is not None:
            return cand.strip("/")
    return None


def _self_attr(node: ast.AST, attr: str | None = None) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr if attr is None or node.attr == attr else None
    return None


class HelperFollower:
    def __init__(self, index: SourceIndex) -> None:
        self.index = index

    def follow(self, layer: ClassKey, kw: str) -> Followed | None:
        """What ``layer``'s forward does with ``kw`` when it hands it to a helper object's method
        (None: it does not)."""
        found = self.index.find_function(layer, "forward")
        if found is None:
            return None
        owner, fi = found
        for call in ast.walk(fi.node):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                continue
            obj = _self_attr(call.func.value)
            if obj is None:
                continue
            param = next((k.arg for k in call.keywords if isinstance(k.value, ast.Name) and k.value.id == kw), None)
            if param is None:
                continue
            where = f"{owner[0]}:{call.lineno}"
            helper = self._helper_class(layer, obj)
            if helper is None:
                return Followed("unknown", f"{where}: hands `{kw}` to self.{obj}.{call.func.attr}()", False,
                                f"{where}: the class of self.{obj} (built in {layer[1]}.__init__) was not found "
                                f"in the engine package, so self.{obj}.{call.func.attr}() was not read")
            return self._read_method(helper, call.func.attr, param, f"{where}: hands `{kw}` to self.{obj}.{call.func.attr}()")
        return None

    def _helper_class(self, layer: ClassKey, attr: str) -> ClassKey | None:
        for k in self.index.mro(layer):
            info = self.index.class_info(k)
            if info is None or "__init__" not in info.functions:
                continue
            for node in ast.walk(info.functions["__init__"].node):
                if not (isinstance(node, ast.Assign) and any(_self_attr(t, attr) for t in node.targets)):
                    continue
                if isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
                    return self._resolve_anywhere(k[0], node.value.func.id)
        return None

    def _resolve_anywhere(self, path: str, name: str) -> ClassKey | None:
        mod = self.index.module(path)
        if mod is None:
            return None
        if name in mod.classes:
            return (path, name)
        if name in mod.imports:
            dotted, attr = mod.imports[name]
            target = package_path(self.index, dotted)
            if target is not None and attr is not None:
                tmod = self.index.module(target)
                if tmod is not None and attr in tmod.classes:
                    return (target, attr)
        return None

    def _read_method(self, helper: ClassKey, method: str, param: str, handed: str) -> Followed:
        found = self.index.find_function(helper, method)
        label = f"{helper[0]}:{helper[1]}.{method}"
        if found is None:
            return Followed("unknown", handed, False, f"{handed}: no {method} in {helper[1]} ({helper[0]})")
        owner, fi = found
        fn = fi.node
        appends = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                   and n.func.attr == "append" and isinstance(n.func.value, ast.Name) and n.func.value.id == param
                   and len(n.args) == 1]
        if len(appends) != 1:
            return Followed("unknown", f"{handed} ({label})", False,
                            f"{owner[0]}:{fi.line}: {label} appends to `{param}` {len(appends)} times; not read")
        append = appends[0]
        at = f"{owner[0]}:{append.lineno}"
        roots = self._roots(fn, append.args[0], append.lineno)
        text = ast.unparse(append.args[0])
        if len(roots) != 1:
            return Followed("unknown", f"{handed}; {at} appends `{text}`", False,
                            f"{at}: `{text}` comes from {sorted(roots) or 'nothing the probe can name'}, "
                            "not from one tensor it can follow")
        root = roots.pop()
        rebind = self._tuple_rebind(fn, root, append.lineno)
        if rebind is None:
            return Followed("unknown", f"{handed}; {at} appends `{text}` (from `{root}`)", False,
                            f"{at}: `{root}` is not rebound by a call such as self.prepare_attn(hidden_states, "
                            f"{root}) before the append; what it holds there was not read")
        callee, line = rebind
        ok, why = self._residual_update(owner, callee, root)
        how = (f"{handed}; {at} appends `{text}`, `{root}` as returned by self.{callee}() ({owner[0]}:{line}): "
               f"{why}")
        if not ok:
            return Followed("unknown", how, False, f"{at}: {why}")
        return Followed("residual_stream", how, True)

    @staticmethod
    def _roots(fn: ast.FunctionDef | ast.AsyncFunctionDef, value: ast.expr, before: int) -> set[str]:
        """The names ``value`` comes from, looking through local assignments before line
        ``before`` (a call's tensor arguments, ``x.clone()``): names never assigned locally, or
        assigned from a tuple unpacking (where the follower stops)."""
        assigns: dict[str, list[ast.expr]] = {}
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and n.lineno < before:
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        assigns.setdefault(t.id, []).append(n.value)
        out: set[str] = set()
        todo = [value]
        seen: set[str] = set()
        while todo:
            e = todo.pop()
            if isinstance(e, ast.Name):
                if e.id in seen:
                    continue
                seen.add(e.id)
                if e.id in assigns:
                    todo.extend(assigns[e.id])
                elif e.id != "self":
                    out.add(e.id)
            elif isinstance(e, ast.Call):
                if isinstance(e.func, ast.Attribute) and e.func.attr in ("clone", "contiguous", "to"):
                    todo.append(e.func.value)
                # a communication function of one tensor: the tensor passed as hidden_states / first
                tensors = [k.value for k in e.keywords if k.arg == "hidden_states"] or e.args[:1]
                todo.extend(tensors)
        return out

    @staticmethod
    def _tuple_rebind(fn: ast.FunctionDef | ast.AsyncFunctionDef, name: str, before: int) -> tuple[str, int] | None:
        """``h, name = self.<m>(h, name, ...)`` before line ``before``: (m, line)."""
        best: tuple[str, int] | None = None
        for n in ast.walk(fn):
            if not (isinstance(n, ast.Assign) and n.lineno < before and isinstance(n.targets[0], ast.Tuple)):
                continue
            elts = n.targets[0].elts
            if not (len(elts) == 2 and isinstance(elts[1], ast.Name) and elts[1].id == name):
                continue
            call = n.value
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and _self_attr(call.func) and \
                    any(isinstance(a, ast.Name) and a.id == name for a in call.args):
                if best is None or n.lineno > best[1]:
                    best = (call.func.attr, n.lineno)
        return best

    def _residual_update(self, helper: ClassKey, method: str, name: str) -> tuple[bool, str]:
        """Every assignment to ``name`` in ``method``: ``name = hidden`` when it is None, or the
        second output of a two-argument norm call on (hidden, name)."""
        found = self.index.find_function(helper, method)
        if found is None:
            return False, f"no {method} in {helper[1]}"
        owner, fi = found
        fused: list[int] = []
        first: list[int] = []
        for n in ast.walk(fi.node):
            if not isinstance(n, ast.Assign):
                continue
            for t in n.targets:
                if isinstance(t, ast.Name) and t.id == name:
                    if isinstance(n.value, ast.Name):
                        first.append(n.lineno)
                        continue
                    return False, f"{owner[0]}:{n.lineno}: `{ast.unparse(n)}` is not read"
                if isinstance(t, ast.Tuple) and any(isinstance(e, ast.Name) and e.id == name for e in t.elts):
                    value = n.value
                    ok = (len(t.elts) == 2 and isinstance(t.elts[1], ast.Name) and t.elts[1].id == name
                          and isinstance(value, ast.Call)
                          and any(isinstance(a, ast.Name) and a.id == name for a in value.args))
                    if not ok:
                        return False, f"{owner[0]}:{n.lineno}: `{ast.unparse(n)}` is not a fused add-norm the probe reads"
                    fused.append(n.lineno)
        if not fused:
            return False, f"{owner[0]}:{fi.line}: {method} never updates `{name}` with a norm call"
        where = ", ".join(f"{owner[0]}:{x}" for x in fused)
        start = (f"; otherwise `{name}` is only set to the layer's input itself (where it is None: the embedding "
                 f"at layer 0) at " + ", ".join(f"{owner[0]}:{x}" for x in first)) if first else ""
        return True, (f"{method} updates `{name}` only as the second output of a two-argument norm "
                      f"(the fused add-RMSNorm: hidden + residual) at {where}{start}: the residual stream at the layer entry")
