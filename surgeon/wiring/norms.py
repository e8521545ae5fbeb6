"""The EAGLE 3.1 norm flags: what the spec declares, what the draft's config says, and what each
engine builds the draft with (read from its source by :mod:`surgeon.engines.facts.draft_norms`), or, for
SpecForge, what the trainer trains it with (:mod:`surgeon.engines.facts.trainer_norms`). A flag the draft
config leaves unset takes speculators' default, read from speculators' ``Eagle3SpeculatorConfig``.

A flag the draft was trained with that the engine does not read, reads but never uses (no use of
the read value in the model file), or reads with another value (a default that differs, a
translation that drops it), is served wrong and silently: an error. Per flag, check-draft reports
what the engine's model file does with it: used (the use site), read but unused, not read, or
unverified (the value escapes to code not read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from surgeon.core.errors import BadInput
from surgeon.core.spec import NORM_FLAGS, Spec
from surgeon.engines.facts.draft_norms import FlagState, NormReading, read_norms
from surgeon.engines.facts.trainer_norms import (
    SPECULATORS_CONFIG,
    logits_only,
    open_trainer,
    read_specforge,
    read_speculators,
    speculators_defaults,
)
from surgeon.engines.source.locate import EngineLocation, ProbeError, locate_engine

# (severity, kind, detail): check-draft wraps these as findings
Line = tuple[str, str, str]
UNSET = "unset"  # the source of a flag the spec and the draft config leave unset starts so
Defaults = dict[str, tuple[bool, str]]  # flag -> (the default, what says so)


@dataclass
class FlagReport:
    """What one engine does with one norm flag, for check-draft's JSON."""

    flag: str
    state: FlagState  # used, read_unused, not_read (also: vLLM's speculators translation drops it), unverified
    read: str | None  # file:line of the read the state rests on
    used_at: str | None  # used: file:line of the use
    builds: bool  # the value the engine builds the draft with
    needs: bool  # the value the draft was trained with
    detail: str


def config_flag(data: dict, flag: str) -> Any:
    """The flag as the draft's config.json sets it: top level, else eagle_config; None: unset."""
    if data.get(flag) is not None:
        return data[flag]
    nested = data.get("eagle_config")
    return nested.get(flag) if isinstance(nested, dict) else None


UNREAD = "not read from its source"  # in a default's reason: taken as False, unverified (a warning)


def trained_defaults(root=None) -> Defaults:
    """flag -> (what a draft config that leaves the flag unset was trained with, why): speculators'
    default, read from its ``Eagle3SpeculatorConfig`` (``root``, else .engines, else installed),
    where its ``Eagle3DraftModel`` uses the flag; False where that model reads it nowhere (a norm
    never built is not trained); False, saying so, where its source is not on this machine, and
    False marked :data:`UNREAD` where the source is there but its default could not be read."""
    src = open_trainer("speculators", root)
    problem = None
    try:
        read = speculators_defaults(src) if src is not None else {}
        model = read_speculators(src) if src is not None else None
    except BadInput as e:
        read, model, problem = {}, None, f"{src.package if src else root}: {e}"
    out: Defaults = {}
    for flag in NORM_FLAGS:
        if src is None:
            out[flag] = (False, f"{UNSET} (speculators' default, taken as False: its source is not on this machine, "
                                "pip install --no-deps speculators==0.9.0; from a checkout, scripts/fetch-engines)")
            continue
        if problem is not None or model is None or flag not in read:
            why = problem or f"{SPECULATORS_CONFIG} gives no literal True/False default for it"
            out[flag] = (False, f"{UNSET} (speculators {src.version}'s default taken as False, {UNREAD}: {why})")
            continue
        default, where = read[flag]
        state, first = model.state(flag)
        who = f"{UNSET} (speculators {src.version}'s default, {where}"
        if state == "used" and first is not None and first.use is not None:
            out[flag] = (default, f"{who}; its model uses it at {first.use.at})")
        elif state == "unverified" and first is not None and first.use is not None:
            out[flag] = (default, f"{who}; its model's use is unverified: {first.use.how})")
        else:
            out[flag] = (False, f"{who}, but its model {model.model_file} never uses it: trained without it)")
    return out


def wanted(spec: Spec, data: dict, defaults: Defaults | None = None) -> dict[str, tuple[bool, str]]:
    """flag -> (the value the draft was trained with, where that comes from): the spec's
    ``draft.norms``, else the draft config, else speculators' default (``defaults``, else read from
    its source by :func:`trained_defaults`)."""
    declared = spec.model.draft.norms if spec.model.draft is not None else None
    defaults = defaults if defaults is not None else trained_defaults()
    out: dict[str, tuple[bool, str]] = {}
    for flag in NORM_FLAGS:
        v = getattr(declared, flag) if declared is not None else None
        c = config_flag(data, flag)
        if v is not None:
            out[flag] = (v, "spec draft.norms")
        elif c is not None:
            out[flag] = (bool(c), "draft config")
        else:
            out[flag] = defaults[flag]
    return out


def _locate(engine: str, engine_root) -> EngineLocation | None:
    try:
        return locate_engine(engine, engine_root)
    except ProbeError:
        return None


def norm_lines(spec: Spec, engine: str, data: dict, engine_root=None) -> list[Line]:
    """check-draft's norm findings for ``engine`` (sglang, vllm, speculators (served by vLLM),
    specforge)."""
    return norm_report(spec, engine, data, engine_root)[0]


def norm_report(spec: Spec, engine: str, data: dict, engine_root=None) -> tuple[list[Line], list[FlagReport]]:
    """check-draft's norm findings for ``engine``, and per flag what the engine does with it
    (empty where the engine's reading is not read: SpecForge, an engine not installed)."""
    if spec.model.draft is None or spec.model.draft.kind != "eagle3":
        return [], []
    declared = spec.model.draft.norms
    lines: list[Line] = []
    for flag in NORM_FLAGS:
        v, c = getattr(declared, flag) if declared is not None else None, config_flag(data, flag)
        if v is not None and c is not None and bool(c) != v:
            lines.append(("error", "norm_config", f"the draft config sets {flag} = {c}, the spec's draft.norms says {v}"))
    want = wanted(spec, data)
    lines += [("warning", "norm_unchecked", f"{flag}: {why}") for flag, (_, why) in want.items() if UNREAD in why]
    if engine == "specforge":
        more, reports = specforge_report(data, want, engine_root)
        return lines + more, reports
    loc = _locate("vllm" if engine == "speculators" else engine, engine_root)
    if loc is None:
        lines.append(("warning", "norm_unchecked", f"{engine} is not installed here: its reading of the norm flags "
                      "is read from its source only (install it or pass --engine-root)"))
        return lines, []
    reading = read_norms(loc, data)
    if reading.model_file is None:
        lines.append(("warning", "norm_unchecked", f"{loc.engine} {loc.version} has no model file for the draft class "
                      f"{reading.model_class!r}: norm flags not checked"))
        return lines, []
    more, reports = engine_report(reading, data, want)
    return lines + more, reports


def flag_report(reading: NormReading, flag: str, data: dict, need: bool) -> FlagReport:
    """What ``reading``'s engine does with ``flag`` for the draft config ``data``."""
    got, why = reading.effective(flag, data)
    state, read = reading.state(flag)
    if reading.translation is not None and flag not in reading.translation:
        state, read = "not_read", None
    used = read.use.at if state == "used" and read is not None and read.use is not None else None
    return FlagReport(flag, state, read.where if read is not None else None, used, got, need, why)


def specforge_report(data: dict, want: dict[str, tuple[bool, str]], root=None) -> tuple[list[Line], list[FlagReport]]:
    """What SpecForge trains the draft with, per flag, against what the draft needs: its draft
    class's reads as for an engine; a ``norm_output`` SpecForge uses only for the logits trains the
    EAGLE-3 state (speculators' and the engines' ``norm_output`` false) whatever its value, and
    with the value false, no norm before lm_head at all (neither EAGLE-3 nor 3.1)."""
    src = open_trainer("specforge", root)
    if src is None:
        return [("warning", "norm_unchecked", "SpecForge's source is not on this machine: its reading of the norm "
                 "flags is read from its source only (pip install --no-deps specforge==0.2.0; from a checkout, "
                 "scripts/fetch-engines; or pass --engine-root)")], []
    reading = read_specforge(src, data)
    if reading.model_file is None:
        return [("warning", "norm_unchecked", f"specforge {src.version} registers no draft class "
                 f"{reading.model_class!r}: norm flags not checked")], []
    meaning = logits_only(src, reading)
    lines: list[Line] = []
    override = None
    if meaning is not None:
        got, why = reading.effective("norm_output", data)
        override = {"norm_output": (False, f"{why}; but {meaning}")}
        if not got:
            lines.append(("error", "norm_mismatch", f"norm_output: specforge {src.version} trains with norm_output = "
                          f"{got} ({why}), so lm_head gets the un-normed state: neither EAGLE-3 nor EAGLE 3.1 ({meaning})"))
    more, reports = engine_report(reading, data, want, override)
    if lines:  # the error above says what norm_output = false trains: no "trains it so" line beside it
        more = [m for m in more if not (m[1] == "norm" and m[2].startswith("norm_output "))]
    return lines + more, reports


def engine_report(reading: NormReading, data: dict, want: dict[str, tuple[bool, str]],
                  override: dict[str, tuple[bool, str]] | None = None) -> tuple[list[Line], list[FlagReport]]:
    """Per flag: what the engine builds the draft with, against what it was trained with (the
    findings), and what the engine's model file does with the flag (the reports); ``override``:
    flag -> (what it builds, why), where the flag's use means something else than its name says."""
    lines: list[Line] = []
    reports: list[FlagReport] = []
    who = f"{reading.engine} {reading.version}"
    builds, wrong = ("trains", "trained") if reading.engine == "specforge" else ("builds", "served")
    for flag in NORM_FLAGS:
        need, src = want[flag]
        r = flag_report(reading, flag, data, need)
        if override is not None and flag in override:
            r.builds, r.detail = override[flag]
        reports.append(r)
        said = need or not src.startswith(UNSET)
        if r.builds == need:
            if r.state == "unverified" and said:
                lines.append(("warning", "norm_unverified", f"{flag} = {need} ({src}); {who} reads it so, but where "
                              f"its value goes was not followed to a use: {r.detail}"))
            elif said:
                lines.append(("info", "norm", f"{flag} = {need} ({src}); {who} {builds} it so: {r.detail}"))
            continue
        kind = {"not_read": "norm_ignored", "read_unused": "norm_unused"}.get(r.state, "norm_mismatch")
        lines.append(("error", kind, f"{flag}: the draft needs {need} ({src}), but {who} {builds} it with {r.builds}: "
                      f"{r.detail}; the draft is {wrong} wrong, silently"))
    return lines, reports


def _render_reading(engine: str, data: dict, engine_root) -> tuple[NormReading | None, dict[str, tuple[bool, str]], str]:
    """(the reading render reports, flag -> (what it builds, why) where the use means otherwise,
    why there is no reading)."""
    if engine == "specforge":
        src = open_trainer("specforge", engine_root)
        if src is None:
            return None, {}, "specforge: its source is not on this machine: its reading of the norm flags is not checked"
        reading = read_specforge(src, data)
        meaning = logits_only(src, reading)
        return reading, ({"norm_output": (False, meaning)} if meaning else {}), ""
    loc = _locate("vllm" if engine == "speculators" else engine, engine_root)
    if loc is None:
        return None, {}, f"{engine}: not installed here: its reading of the norm flags is not checked"
    return read_norms(loc, data), {}, ""


def render_lines(spec: Spec, engine: str, engine_root=None) -> list[str]:
    """For render/explain: whether ``engine`` reads each norm flag the spec declares (file:line),
    for a config that sets them at the top level, as speculators writes them. The draft class is
    the engine's Llama EAGLE-3 class (the spec does not name the draft's class); for SpecForge,
    what it trains the draft with."""
    if spec.model.draft is None or spec.model.draft.kind != "eagle3" or spec.model.draft.norms is None:
        return []
    if engine not in ("sglang", "vllm", "speculators", "specforge"):
        return [f"{engine}: how it reads the norm flags is not modelled"]
    data: dict[str, Any] = {f: v for f in NORM_FLAGS if (v := getattr(spec.model.draft.norms, f)) is not None}
    if engine == "speculators":
        data["speculators_model_type"] = "eagle3"
    reading, override, why = _render_reading(engine, data, engine_root)
    if reading is None:
        return [why]
    who = "the trainer trains" if engine == "specforge" else "the engine builds"
    out = []
    for flag in (f for f in NORM_FLAGS if f in data):
        r = flag_report(reading, flag, data, data[flag])
        if flag in override:
            r.builds, r.detail = r.builds and override[flag][0], f"{r.detail}; but {override[flag][1]}"
        state = {"used": f"used at {r.used_at}", "unverified": "read, its use unverified",
                 "read_unused": "read but unused", "not_read": "not read"}[r.state]
        if r.builds != data[flag]:
            state = f"NOT {'TRAINED' if engine == 'specforge' else 'SERVED'}: {who} the draft with {r.builds}"
        elif flag in override and not data[flag]:  # SpecForge's norm_output false: no norm before lm_head at all
            state = (f"NOT TRAINED: {who} the draft with lm_head on the un-normed state, neither EAGLE-3 nor "
                     "EAGLE 3.1 (leave norm_output unset or true for SpecForge)")
        out.append(f"{engine}: norm flag {flag} = {data[flag]}: {state} ({reading.model_class}): {r.detail}")
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
