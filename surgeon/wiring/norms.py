"""The EAGLE 3.1 norm flags: what the spec declares, what the draft's config says, and what each
engine builds the draft with (read from its source by :mod:`surgeon.engines.draft_norms`).

A flag the draft was trained with that the engine does not read, or reads with another value (a
default that differs, a translation that drops it), is served wrong and silently: an error.
"""

from __future__ import annotations

from typing import Any

from surgeon.core.spec import NORM_FLAGS, Spec
from surgeon.engines.draft_norms import NormReading, read_norms
from surgeon.engines.locate import EngineLocation, ProbeError, locate_engine

# (severity, kind, detail): check-draft wraps these as findings
Line = tuple[str, str, str]
SPECULATORS_DEFAULT = False  # speculators 0.9.0 models/eagle3/config.py: every norm flag defaults to False


def config_flag(data: dict, flag: str) -> Any:
    """The flag as the draft's config.json sets it: top level, else eagle_config; None: unset."""
    if data.get(flag) is not None:
        return data[flag]
    nested = data.get("eagle_config")
    return nested.get(flag) if isinstance(nested, dict) else None


def wanted(spec: Spec, data: dict) -> dict[str, tuple[bool, str]]:
    """flag -> (the value the draft was trained with, where that comes from): the spec's
    ``draft.norms``, else the draft config, else speculators' default (False)."""
    declared = spec.model.draft.norms if spec.model.draft is not None else None
    out: dict[str, tuple[bool, str]] = {}
    for flag in NORM_FLAGS:
        v = getattr(declared, flag) if declared is not None else None
        c = config_flag(data, flag)
        if v is not None:
            out[flag] = (v, "spec draft.norms")
        elif c is not None:
            out[flag] = (bool(c), "draft config")
        else:
            out[flag] = (SPECULATORS_DEFAULT, "unset (speculators' default)")
    return out


def _locate(engine: str, engine_root) -> EngineLocation | None:
    try:
        return locate_engine(engine, engine_root)
    except ProbeError:
        return None


def norm_lines(spec: Spec, engine: str, data: dict, engine_root=None) -> list[Line]:
    """check-draft's norm findings for ``engine`` (sglang, vllm, speculators (served by vLLM),
    specforge)."""
    if spec.model.draft is None or spec.model.draft.kind != "eagle3":
        return []
    declared = spec.model.draft.norms
    lines: list[Line] = []
    for flag in NORM_FLAGS:
        v, c = getattr(declared, flag) if declared is not None else None, config_flag(data, flag)
        if v is not None and c is not None and bool(c) != v:
            lines.append(("error", "norm_config", f"the draft config sets {flag} = {c}, the spec's draft.norms says {v}"))
    want = wanted(spec, data)
    if engine == "specforge":
        if declared is not None:
            lines.append(("warning", "norm_unchecked", "how SpecForge reads the norm flags is not modelled; not checked"))
        return lines
    loc = _locate("vllm" if engine == "speculators" else engine, engine_root)
    if loc is None:
        lines.append(("warning", "norm_unchecked", f"{engine} is not installed here: its reading of the norm flags "
                      "is read from its source only (install it or pass --engine-root)"))
        return lines
    reading = read_norms(loc, data)
    if reading.model_file is None:
        lines.append(("warning", "norm_unchecked", f"{loc.engine} {loc.version} has no model file for the draft class "
                      f"{reading.model_class!r}: norm flags not checked"))
        return lines
    return lines + engine_lines(reading, data, want)


def engine_lines(reading: NormReading, data: dict, want: dict[str, tuple[bool, str]]) -> list[Line]:
    """Per flag: what the engine builds the draft with, against what it was trained with."""
    lines: list[Line] = []
    who = f"{reading.engine} {reading.version}"
    for flag in NORM_FLAGS:
        got, why = reading.effective(flag, data)
        need, src = want[flag]
        if got == need:
            if need or src != "unset (speculators' default)":
                lines.append(("info", "norm", f"{flag} = {need} ({src}); {who} builds it so: {why}"))
            continue
        kind = "norm_ignored" if "never reads" in why or "does not copy" in why else "norm_mismatch"
        lines.append(("error", kind, f"{flag}: the draft needs {need} ({src}), but {who} builds it with {got}: {why}; "
                      "the draft is served wrong, silently"))
    return lines


def render_lines(spec: Spec, engine: str, engine_root=None) -> list[str]:
    """For render/explain: whether ``engine`` reads each norm flag the spec declares (file:line),
    for a config that sets them at the top level, as speculators writes them. The draft class is
    the engine's Llama EAGLE-3 class (the spec does not name the draft's class)."""
    if spec.model.draft is None or spec.model.draft.kind != "eagle3" or spec.model.draft.norms is None:
        return []
    if engine not in ("sglang", "vllm", "speculators"):
        return [f"{engine}: how it reads the norm flags is not modelled"]
    loc = _locate("vllm" if engine == "speculators" else engine, engine_root)
    if loc is None:
        return [f"{engine}: not installed here: its reading of the norm flags is not checked"]
    data: dict[str, Any] = {f: v for f in NORM_FLAGS if (v := getattr(spec.model.draft.norms, f)) is not None}
    if engine == "speculators":
        data["speculators_model_type"] = "eagle3"
    reading = read_norms(loc, data)
    out = []
    for flag in (f for f in NORM_FLAGS if f in data):
        got, why = reading.effective(flag, data)
        state = "read" if got == data[flag] else f"NOT SERVED: the engine builds the draft with {got}"
        out.append(f"{engine}: norm flag {flag} = {data[flag]}: {state} ({reading.model_class}): {why}")
    return out


# The tensors each flag adds to a draft (speculators 0.9.0 models/eagle3/core.py: input_norm,
# fc_norm.{i}); vLLM's loader drops input_norm.* when norm_before_fc is off (llama_eagle3.py
# load_weights), so trained norm weights under a config without the flag vanish, silently.
NORM_WEIGHTS = {"norm_before_fc": "input_norm.weight", "fc_norm": "fc_norm.0.weight"}


def weight_lines(spec: Spec, data: dict, names: list[tuple[str, str]]) -> list[Line]:
    """The draft's norm tensors (``names``: (file, tensor)) against the flags it needs."""
    if spec.model.draft is None or spec.model.draft.kind != "eagle3" or not names:
        return []
    want = wanted(spec, data)
    lines: list[Line] = []
    for flag, suffix in NORM_WEIGHTS.items():
        hits = [f"{file}:{t}" for file, t in names if t in (suffix, f"model.{suffix}")]
        need, src = want[flag]
        if hits and not need:
            lines.append(("error", "norm_weights", f"{hits[0]} is a trained {flag} norm, but {flag} is {need} ({src}): "
                          "the engine builds no such norm (vLLM's llama_eagle3.py load_weights drops input_norm.*), so the "
                          "trained norm is not applied, silently; set "
                          f"{flag}: true in the draft config (and the spec's draft.norms)"))
        elif need and not hits:
            lines.append(("warning", "norm_weights", f"{flag} is {need} ({src}) but the draft has no {suffix}: "
                          "the engine's norm would keep its initial weight"))
    return lines
