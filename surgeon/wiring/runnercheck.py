"""Refuse a wiring the engine's model runner cannot serve, naming the release and the runner call.

The model class's setter decides what ids mean; the runner decides which ids arrive. When the probe
read (``EngineProbe.runner``, from :mod:`surgeon.engines.probes.runner`) that every setter call in the
release's runner passes the model's own default (vLLM 0.11's ``gpu_model_runner.py``), the draft's
ids never reach the model: any spec whose captures differ from that default is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from surgeon.core.idrules import ClassConvention, EngineProbe
from surgeon.core.points import Point

_TITLES = {"vllm": "vLLM", "sglang": "SGLang"}


def _points(positions: Sequence[int | None]) -> str:
    return "[" + ", ".join("never captured" if p is None else str(Point.at_position(p)) for p in positions) + "]"


def runner_ignores_ids(probe: EngineProbe | None) -> str | None:
    """"<release> ignores the draft's ids: <file:line> always sets <method>()" when the probe read
    that every setter call in the release's runner passes the model's own default; else None."""
    runner = probe.runner if probe is not None else None
    if probe is None or runner is None or not runner.ignores_draft_ids:
        return None
    release = f"{_TITLES.get(probe.engine, probe.engine)} {probe.version}"
    calls = ", ".join(f"{c.where} always sets {c.default_method + '()' if c.default_method else 'no ids (the default)'}"
                      for c in runner.calls)
    return f"{release} ignores the draft's ids: {calls}"


def runner_refusal(probe: EngineProbe | None, cc: ClassConvention, ids: Sequence[int], num_layers: int) -> str | None:
    """Why ``probe``'s release cannot serve ``ids`` on ``cc`` because its runner ignores them, or
    None (the runner passes the draft's ids, was not read, or forces exactly these captures)."""
    ignores = runner_ignores_ids(probe)
    if ignores is None:
        return None
    try:
        served = cc.capture(None, num_layers)
    except ValueError as e:
        return f"{ignores}, and {e}"
    wanted = cc.capture(list(ids), num_layers)
    if served == wanted:
        return None
    return f"{ignores}; {cc.class_name} then captures {_points(served)}, the spec needs {_points(wanted)}"


def runner_graph_hazard(probe: EngineProbe | None, cc: ClassConvention, ids: Sequence[int], num_layers: int,
                        kind: str = "eagle3") -> str | None:
    """Where the release's runner builds its device graphs with the model's default before the
    draft's ids arrive (:attr:`RunnerModel.graph_default`, SGLang 0.5.5) and ``ids`` capture other
    states than that default: the order as read and both captures; else None."""
    runner = probe.runner.for_kind(kind) if probe is not None and probe.runner is not None else None
    if probe is None or runner is None or runner.graph_default is None:
        return None
    wanted = cc.capture(list(ids), num_layers)
    try:
        served = cc.capture(None, num_layers)
    except ValueError as e:
        served_text = f"no default ({e})"
    else:
        if served == wanted:
            return None
        served_text = _points(served)
    release = f"{_TITLES.get(probe.engine, probe.engine)} {probe.version}"
    return (f"{release} runner: {runner.graph_default}; {cc.class_name}'s default captures {served_text}, "
            f"this wiring {_points(wanted)}")


def runner_notes(probe: EngineProbe | None, kind: str = "eagle3") -> list[str]:
    """What the runner read says about this rendering of a ``kind`` draft: each call passing the
    draft's ids (file:line, the config keys it reads and their offsets), or why the runner is not
    verified (only the setter calls that ``kind``'s ids go through count)."""
    runner = probe.runner.for_kind(kind) if probe is not None and probe.runner is not None else None
    if probe is None or runner is None:
        return []
    release = f"{_TITLES.get(probe.engine, probe.engine)} {probe.version}"
    if not runner.verified:
        reason = (runner.reason or "").removeprefix("not verified: ")
        return [f"{release} runner unverified: {reason}"]
    ignores = runner_ignores_ids(probe)
    if ignores:  # reached only when the wiring is that default (else runner_refusal refused)
        return [f"{ignores}: the draft config's ids are not read there, and this wiring is that default"]
    notes = []
    for c in runner.calls:
        if c.passes == "draft_ids":
            keys = ", ".join(dict.fromkeys(f"{s.key}{f' {s.offset:+d}' if s.offset else ''}" for s in c.sources
                                           if s.origin == "draft_config"))
            other = "".join(f"; ids from the engine's {s.key} ({s.path}:{s.line})"
                            + (f" instead when {s.when}" if s.when else ", under a condition not read")
                            for s in c.sources if s.origin == "engine")
            notes.append(f"{release} runner {c.where} passes the draft config's ids ({keys})"
                         + (f", else {c.default_method}()" if c.default_method else "")
                         + (f" ({c.detail})" if c.detail and c.detail.startswith("read through") else "") + other)
    return notes
