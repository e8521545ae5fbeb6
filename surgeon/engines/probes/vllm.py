"""vLLM: classes that own aux hidden states (``EagleModelMixin`` holders) and the outer classes the
engine drives through ``SupportsEagle3``.

The GPU model runner does ``model.set_aux_hidden_state_layers(ids or
model.get_eagle3_default_aux_hidden_state_layers())``. Both methods live in
``model_executor/models/interfaces.py`` (``SupportsEagle3``), which forwards to the holder's
``EagleModelMixin._set_aux_hidden_state_layers`` (``tuple(sorted(set(layers)))``); models may
override either. The probe runs those bodies symbolically from the installed ``interfaces.py``
and model files, so sorting, de-duplication, the default and any override are read, not assumed.

Runtime machinery the interpreter cannot read into is modelled here, each from its documented
behaviour: ``SupportsMultiModal.get_language_model`` returns the module built inside
``with self._mark_language_model(...)``; ``init_vllm_registered_model(..., architectures=[A])``
builds the class the registry (``registry.py``) maps ``A`` to (without ``architectures`` the
class comes from the checkpoint's config at runtime, which the probe says rather than guesses);
``initialize_model(..., model_class=C)`` builds ``C``.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator

import libcst as cst
import libcst.matchers as m

from surgeon.core.idrules import ArchDispatch, ClassConvention, PlatformTarget
from surgeon.engines.interp import ClassRef, Const, Hooks, InterpBase, Obj, Tup, Unknown, Value
from surgeon.engines.probes.classify import RUNTIME_LANGUAGE_MODEL, EntryPoint, Target
from surgeon.engines.probes.dispatch import DEFAULT_PLATFORM, DispatchResolver, Resolution
from surgeon.engines.source.index import ClassKey, CstFunction, SourceIndex

MODELS = "model_executor/models"
INTERFACES = f"{MODELS}/interfaces.py"
REGISTRY = f"{MODELS}/registry.py"
MIXIN: ClassKey = (INTERFACES, "EagleModelMixin")
PROTOCOL: ClassKey = (INTERFACES, "SupportsEagle3")
MULTIMODAL: ClassKey = (INTERFACES, "SupportsMultiModal")
SETTER = "set_aux_hidden_state_layers"
DEFAULT = "get_eagle3_default_aux_hidden_state_layers"
HOLDER_SETTER = "_set_aux_hidden_state_layers"
ATTR = "aux_hidden_state_layers"
TRIGGERS = ("SupportsEagle3", "EagleModelMixin", SETTER, ATTR)

# vLLM 0.11 and earlier name the default ``get_eagle3_aux_hidden_state_layers`` in SupportsEagle3 and
# have no EagleModelMixin: each model's setter writes its inner model's attribute itself.
LEGACY_DEFAULT = "get_eagle3_aux_hidden_state_layers"
OUTER = EntryPoint(setter=SETTER, default_method=DEFAULT, default_through_rule=True)


def outer_entry(index: SourceIndex) -> EntryPoint:
    """How this release drives an outer class: the default method is the one its SupportsEagle3
    declares (``get_eagle3_default_aux_hidden_state_layers``, or the legacy name in 0.11)."""
    proto = index.class_info(PROTOCOL)
    if proto is not None and DEFAULT not in proto.functions and LEGACY_DEFAULT in proto.functions:
        return EntryPoint(setter=SETTER, default_method=LEGACY_DEFAULT, default_through_rule=True)
    return OUTER


def select(index: SourceIndex, only: Collection[str] | None = None) -> tuple[list[Target], list[str]]:
    """Classes to classify (those of the files ``only``, when given), and the files they come from."""
    files, names = index.prefilter(TRIGGERS)
    targets: list[Target] = []
    holder_entry = EntryPoint(setter=HOLDER_SETTER)
    direct_entry = EntryPoint(setter=None, attr=ATTR)
    outer_ep = outer_entry(index)
    for ci in index.classes_in(files if only is None else [f for f in files if f in only]):
        if ci.name not in names:
            continue
        if ci.path == INTERFACES:
            continue
        mro = index.mro(ci.key)
        own = set(ci.functions)
        outer = PROTOCOL in mro or index.find_function(ci.key, SETTER) is not None
        owns_attr = any(_init_assigns(index, k, ATTR) for k in mro)
        holder = MIXIN in mro or owns_attr
        bases = set(index.bases(ci.key))
        defines = bool(
            bases & {PROTOCOL, MIXIN}
            or own & {SETTER, DEFAULT, LEGACY_DEFAULT, HOLDER_SETTER}
            or _init_assigns(index, ci.key, ATTR)
        )
        if outer:
            targets.append(Target(ci.key, outer_ep, defines))
        elif holder:
            entry = holder_entry if index.find_function(ci.key, HOLDER_SETTER) else direct_entry
            targets.append(Target(ci.key, entry, defines))
    return targets, files


def _init_assigns(index: SourceIndex, key: ClassKey, attr: str) -> bool:
    """The class's constructor assigns ``self.<attr>`` (a text search of ``__init__``, then ast)."""
    info = index.class_info(key)
    if info is None or "__init__" not in info.functions:
        return False
    fi = info.functions["__init__"]
    if f"self.{attr}" not in index.function_text(key, fi):
        return False
    for node in ast.walk(fi.node):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name) and t.value.id == "self":
                return True
    return False


def registry_entries(index: SourceIndex) -> dict[str, tuple[str, str]]:
    """Architecture name -> (module as the registry writes it, class name), from ``registry.py``'s
    tables (read with ast, never imported). ``_VLLM_MODELS`` merges the tables in order, later
    ones winning; it is honoured when present."""
    mod = index.module(REGISTRY)
    if mod is None:
        return {}
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    for name, value in mod.assigns.items():
        if isinstance(value, ast.Dict):
            table: dict[str, tuple[str, str]] = {}
            for k, v in zip(value.keys, value.values):
                pair = _str_pair(v)
                if isinstance(k, ast.Constant) and isinstance(k.value, str) and pair is not None:
                    table[k.value] = pair
            tables[name] = table
    merged: dict[str, tuple[str, str]] = {}
    order = []
    combined = mod.assigns.get("_VLLM_MODELS")
    if isinstance(combined, ast.Dict):
        order = [v.id for k, v in zip(combined.keys, combined.values) if k is None and isinstance(v, ast.Name)]
    for name in order or list(tables):
        merged.update(tables.get(name, {}))
    return merged


def dotted_module(module: str) -> str:
    """The module a registry entry imports: ``vllm.<...>`` as written (vLLM's
    ``_resolve_module_name``), else ``vllm.model_executor.models.<module>``."""
    return module if module.startswith("vllm.") else f"vllm.{MODELS.replace('/', '.')}.{module}"


def dispatched(index: SourceIndex) -> dict[str, tuple[str, str]]:
    """The registry entries whose module is not a flat model file (``vllm.models.<family>``):
    the ones whose class the release picks per platform."""
    return {a: (dotted_module(mod), cls) for a, (mod, cls) in registry_entries(index).items()
            if not dotted_module(mod).startswith(f"vllm.{MODELS.replace('/', '.')}.")}


def registry(index: SourceIndex, platform: str = DEFAULT_PLATFORM,
             resolver: DispatchResolver | None = None) -> dict[str, ClassKey]:
    """Architecture name -> the class that runs on ``platform``. A flat entry is its file's class;
    an entry naming a dispatching package (``vllm.models.deepseek_v32``) is followed through the
    package's ``__init__.py`` (:mod:`surgeon.engines.probes.dispatch`), and left out when the answer is
    not verified (``EngineProbe.dispatch`` says why)."""
    resolver = resolver or DispatchResolver(index)
    routed = dispatched(index)
    out: dict[str, ClassKey] = {}
    for arch, (module, cls) in registry_entries(index).items():
        if arch in routed:
            target = resolver.resolve(*routed[arch], platform).target
            if target is not None:
                out[arch] = target
        else:
            out[arch] = (f"{MODELS}/{module.replace('.', '/')}.py", cls)
    return out


class VllmHooks(Hooks):
    def __init__(self, index: SourceIndex, platform: str = DEFAULT_PLATFORM) -> None:
        self.index = index
        self.platform = platform
        self._registry: dict[str, ClassKey] | None = None

    @property
    def table(self) -> dict[str, ClassKey]:
        if self._registry is None:
            self._registry = registry(self.index, self.platform)
        return self._registry

    def call_function(self, interp: InterpBase, name: str, args: list[Value], kwargs: dict[str, Value]) -> Value | None:
        if name == "init_vllm_registered_model":
            archs = kwargs.get("architectures")
            if archs is None:
                return Unknown(f"{RUNTIME_LANGUAGE_MODEL} from the checkpoint's "
                               "text config (init_vllm_registered_model without architectures=)")
            if isinstance(archs, Tup) and archs.items and isinstance(archs.items[0], Const):
                arch = archs.items[0].value
                target = self.table.get(arch)
                if target is None or self.index.class_info(target) is None:
                    return Unknown(f"architecture {arch!r}, which the registry does not map to a model file")
                return Obj(target, f"{target[1]}()")
            return Unknown("init_vllm_registered_model with computed architectures")
        if name == "initialize_model":
            cls = kwargs.get("model_class")
            if isinstance(cls, ClassRef):
                return Obj(cls.cls, f"{cls.cls[1]}()")
            return Unknown("initialize_model without a model_class the probe can resolve")
        return None

    def call_method(self, interp: InterpBase, owner: ClassKey, name: str, obj: Obj | None,
                    args: list[Value], kwargs: dict[str, Value]) -> Value | None:
        if owner == MULTIMODAL and name == "get_language_model" and obj is not None:
            return self._language_model(interp, obj)
        return None

    def _language_model(self, interp: InterpBase, obj: Obj) -> Value:
        """The attribute assigned inside ``with self._mark_language_model(...)`` in a constructor."""
        mark_call = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("_mark_language_model")))
        marker = m.With(items=[m.WithItem(item=mark_call)])
        memo = self.index.memo.setdefault("language_model", {})  # the source decides: once per class
        if obj.cls in memo:
            return self._language_model_value(interp, obj, memo[obj.cls])
        names: list[str] = []
        for fn in self._constructors_mentioning(obj.cls, "_mark_language_model"):
            for block in fn.findall(marker):
                for target, value in _self_attr_assigns(fn, block):
                    # Only child modules are marked; tensors made by torch.* (buffers) and None are not.
                    if value is None or m.matches(value, m.Name("None")) or _torch_call(value):
                        continue
                    if target.attr.value not in names:
                        names.append(target.attr.value)
            if names:
                break
        if not names and self._falls_back_to_children():
            names = self._registered_children(obj)
        memo[obj.cls] = names
        return self._language_model_value(interp, obj, names)

    def _constructors_mentioning(self, cls: ClassKey, word: str) -> Iterator[CstFunction]:
        """The ``__init__`` of each class in ``cls``'s MRO whose text mentions ``word``, nearest
        first (a text test before the libcst parse)."""
        for k in self.index.mro(cls):
            info = self.index.class_info(k)
            if info is None or "__init__" not in info.functions:
                continue
            if word not in self.index.function_text(k, info.functions["__init__"]):
                continue
            fn = self.index.function(k, "__init__")
            if fn is not None:
                yield fn

    def _falls_back_to_children(self) -> bool:
        """The release's ``SupportsMultiModal.get_language_model`` falls back to the first child
        module that is a language model when none is marked (read from interfaces.py, 0.32+)."""
        info = self.index.class_info(MULTIMODAL)
        fi = info.functions.get("get_language_model") if info else None
        return fi is not None and ".children()" in self.index.function_text(MULTIMODAL, fi)

    def _registered_children(self, obj: Obj) -> list[str]:
        """``self.X = init_vllm_registered_model(...)`` in the constructor: the children the
        fallback can find as a language model (vision towers and projectors are not built that way)."""
        made = m.Assign(targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))],
                        value=m.Call(func=m.Name("init_vllm_registered_model")))
        for fn in self._constructors_mentioning(obj.cls, "init_vllm_registered_model"):
            found = [a.targets[0].target.attr.value for a in fn.findall(made)
                     if isinstance(a, cst.Assign) and isinstance(a.targets[0].target, cst.Attribute)]
            return list(dict.fromkeys(found))
        return []

    @staticmethod
    def _language_model_value(interp: InterpBase, obj: Obj, names: list[str]) -> Value:
        if len(names) == 1:
            return interp.load_attr(obj, names[0])
        if not names:
            return Unknown(f"{obj.cls[1]} marks no language model (get_language_model would raise)")
        return Unknown(f"{obj.cls[1]} marks several language-model modules ({', '.join(names)})")


def _str_pair(node: ast.expr) -> tuple[str, str] | None:
    """The two strings of a registry value like ``("llama", "LlamaForCausalLM")``, or None."""
    if isinstance(node, ast.Tuple) and len(node.elts) == 2:
        first, second = node.elts
        if (isinstance(first, ast.Constant) and isinstance(first.value, str)
                and isinstance(second, ast.Constant) and isinstance(second.value, str)):
            return first.value, second.value
    return None


def _self_attr_assigns(fn: CstFunction, block: cst.CSTNode) -> list[tuple[cst.Attribute, cst.BaseExpression | None]]:
    """``self.x = value`` then ``self.x: T = value`` inside ``block``: (target, value) pairs.
    The isinstance tests only restate what the matchers already guarantee, for the type checker."""
    self_attr = m.Attribute(value=m.Name("self"))
    assigns: list[tuple[cst.Attribute, cst.BaseExpression | None]] = []
    for node in fn.findall(m.Assign(targets=[m.AssignTarget(target=self_attr)]), within=block):
        if isinstance(node, cst.Assign) and isinstance(node.targets[0].target, cst.Attribute):
            assigns.append((node.targets[0].target, node.value))
    for node in fn.findall(m.AnnAssign(target=self_attr), within=block):
        if isinstance(node, cst.AnnAssign) and isinstance(node.target, cst.Attribute):
            assigns.append((node.target, node.value))
    return assigns


def _torch_call(node: cst.BaseExpression) -> bool:
    if not isinstance(node, cst.Call):
        return False
    func = node.func
    while isinstance(func, cst.Attribute):
        func = func.value
    return m.matches(func, m.Name("torch"))


def hooks(index: SourceIndex, platform: str = DEFAULT_PLATFORM) -> Hooks:
    return VllmHooks(index, platform)


def extra_notes(index: SourceIndex):
    """Notes on look-alike methods the interface never calls (e.g. ``get_eagle3_aux_hidden_state_layers``
    defined where ``get_eagle3_default_aux_hidden_state_layers`` is what the engine calls)."""
    proto = index.class_info(PROTOCOL)
    interface = set(proto.functions) if proto else {SETTER, DEFAULT}

    def notes(key: ClassKey) -> list[str]:
        out = []
        for k in index.mro(key):
            if k[0] == INTERFACES:
                continue
            info = index.class_info(k)
            for name in (info.functions if info else {}):
                if name.startswith("get_eagle3") and name not in interface:
                    out.append(f"{k[1]}.{name} is not part of SupportsEagle3 ({', '.join(sorted(interface))}); "
                               f"the engine never calls it")
        return out

    return notes


def check_interface(index: SourceIndex) -> str | None:
    """Why the installed interfaces.py cannot be used, or None. A release without EagleModelMixin
    (vLLM 0.11: each model's own setter writes the holder's attribute, read symbolically like any
    override) is fine as long as SupportsEagle3 declares the setter and a default method."""
    proto = index.class_info(PROTOCOL)
    if proto is None:
        return f"{INTERFACES} defines no SupportsEagle3"
    default = outer_entry(index).default_method
    missing = [n for n in (SETTER, default) if n is not None and n not in proto.functions]
    mixin = index.class_info(MIXIN)
    if mixin is not None and HOLDER_SETTER not in mixin.functions:
        missing.append(f"EagleModelMixin.{HOLDER_SETTER}")
    if missing:
        return f"{INTERFACES} no longer defines {', '.join(missing)}"
    return None


def exported(index: SourceIndex, paths: list[str], platform: str = DEFAULT_PLATFORM) -> dict[str, ClassKey]:
    return registry(index, platform)


COMPARED_PLATFORMS = ("cuda", "rocm", "cpu")


def dispatch_table(index: SourceIndex, platform: str, by_class: dict[ClassKey, str],
                   classes: dict[str, ClassConvention], resolver: DispatchResolver | None = None) -> dict[str, ArchDispatch]:
    """For each registry entry that names a dispatching package: what runs on ``platform`` and on
    the other platforms compared, with the import that decides, and a sentence where they differ
    (another class, or the same ids meaning other captures)."""
    resolver = resolver or DispatchResolver(index)
    out: dict[str, ArchDispatch] = {}
    platforms = (platform, *(p for p in COMPARED_PLATFORMS if p != platform))
    for arch, (module, cls) in sorted(dispatched(index).items()):
        targets = tuple(_platform_target(resolver.resolve(module, cls, p), by_class) for p in platforms)
        out[arch] = ArchDispatch(arch, module, platform, targets, _disagreement(targets, classes))
    return out


def _platform_target(res: Resolution, by_class: dict[ClassKey, str]) -> PlatformTarget:
    target = res.target
    if target is not None:
        c = res.candidates[0]
        return PlatformTarget(res.platform, c.path, c.class_name, c.line, c.evidence, True, None, by_class.get(target))
    first = res.candidates[0] if res.candidates else None
    return PlatformTarget(res.platform, None, res.name, 0, first.evidence if first else "", False, res.reason)


def _capture_signature(cc: ClassConvention | None) -> tuple:
    if cc is None:
        return ("no capture interface",)
    return (cc.status, cc.no_capture, cc.id_rule.name if cc.id_rule else None,
            tuple(str(t) for t in cc.default) if cc.default is not None else None, cc.default_through_rule,
            cc.sorts, cc.dedups, cc.emit_order, cc.capture_site, cc.captured_value, cc.tail_capture)


def _disagreement(targets: tuple[PlatformTarget, ...], classes: dict[str, ClassConvention]) -> str | None:
    if any(not t.verified for t in targets):
        unverified = [t.platform for t in targets if not t.verified]
        return f"not verified on {', '.join(unverified)}"
    if len({(t.path, t.class_name) for t in targets}) == 1:
        return None
    sigs = {_capture_signature(classes.get(t.convention) if t.convention else None) for t in targets}
    if len(sigs) > 1:
        return "the platforms run different classes and their captures differ"
    return "the platforms run different classes with the same captures"
