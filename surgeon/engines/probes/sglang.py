"""SGLang: model classes that define or inherit ``set_eagle3_layers_to_capture``.

The model runner calls ``model.set_eagle3_layers_to_capture(layer_ids)`` with the draft config's
``eagle_aux_hidden_state_layer_ids`` (``None`` when it has none). The setter's body is run
symbolically (:mod:`surgeon.engines.interp`), so the id rule (``+1``, deepseek_v2.py's
``+1 if ids[0] == 1 else +0``, a forwarded ``[val + 1 ...]`` composed with an inner setter), the
default list and the class that ends up holding ``layers_to_capture`` all come from the installed
source; the holder's layer loop then gives the capture site and value.
"""

from __future__ import annotations

import ast
from collections.abc import Collection

from surgeon.engines.interp import Hooks
from surgeon.engines.probes.classify import EntryPoint, Target
from surgeon.engines.source.index import ClassKey, SourceIndex

SETTER = "set_eagle3_layers_to_capture"
TRIGGERS = (SETTER,)
ENTRY = EntryPoint(setter=SETTER)
# DFlash drafts reach the same classes through another setter (``configure_aux_hidden_state_capture``
# calls it with the draft's ``dflash_config.target_layer_ids``); :mod:`surgeon.engines.facts.sglang_dflash`
# classifies it with the same machinery, per class, on demand.
DFLASH_SETTER = "set_dflash_layers_to_capture"
DFLASH_ENTRY = EntryPoint(setter=DFLASH_SETTER)


def select(index: SourceIndex, only: Collection[str] | None = None) -> tuple[list[Target], list[str]]:
    """Classes to classify (those of the files ``only``, when given), and the files they come from."""
    files, names = index.prefilter(TRIGGERS)
    targets: list[Target] = []
    for ci in index.classes_in(files if only is None else [f for f in files if f in only]):
        if ci.name not in names:
            continue
        found = index.find_function(ci.key, SETTER)
        if found is not None:
            targets.append(Target(ci.key, ENTRY, defines=found[0] == ci.key))
    return targets, files


def hooks(index: SourceIndex) -> Hooks:
    return Hooks()


def extra_notes(index: SourceIndex):
    return None


def exported(index: SourceIndex, paths: list[str]) -> dict[str, ClassKey]:
    """Architecture name -> class: SGLang registers each module's ``EntryClass`` under its name."""
    out: dict[str, ClassKey] = {}
    for path in paths:
        mod = index.module(path)
        if mod is None or "EntryClass" not in mod.assigns:
            continue
        value = mod.assigns["EntryClass"]
        items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
        for item in items:
            r = index.resolve_expr(path, item)
            if isinstance(r, tuple):
                out.setdefault(r[1], r)
    return out
