"""The judges of :mod:`surgeon.patch.routes`: one function per route, each reading the release's
source through the library's probes (render's ids, the native capture facts of
:mod:`surgeon.engines.probes.native`, the patch planner) and returning a :class:`RoutePlan`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from surgeon.core.errors import BadInput
from surgeon.core.points import Point
from surgeon.patch.routes.model import TITLES, PlanInput, RoutePlan, Verdict, engine_launch, refused
from surgeon.patch.routes.native import engine_native, trtllm_native

_NO_TRTLLM_SOURCE = ("TensorRT-LLM is not patched by surgeon: its PyPI package is a stub, so there is no model file "
                     "to read or rewrite here")


def release_of(inp: PlanInput) -> tuple[str | None, str | None, list[str]]:
    """(the release planned for, the model class, notes on where the answers come from)."""
    if inp.engine == "trtllm":
        return None, None, ["trtllm: answers from tables cited from TensorRT-LLM's GitHub source at a commit "
                            "(its PyPI package is a stub): not a release read here"]
    from surgeon.engines.view import model_class_for, open_engine

    view = open_engine(inp.engine, inp.engine_root)
    notes = [f"{inp.engine}: {view.origin}"]
    return view.version, model_class_for(inp.spec, inp.engine), notes


def judge(route: str, inp: PlanInput, needs: dict[str, list[str]]) -> RoutePlan:
    """``route`` judged for every need of ``inp``; an error while reading the engine refuses the
    route with that error's message rather than stopping the whole plan."""
    judges: dict[str, Callable[[PlanInput, Sequence[str]], RoutePlan]] = {
        "config": config_route, "native": native_route, "plugin": plugin_route, "patch": patch_route,
    }
    try:
        return judges[route](inp, list(needs))
    except BadInput as e:
        return RoutePlan(route, TITLES[route], refused(_reason(inp, e), list(needs)))


def _reason(inp: PlanInput, e: BadInput) -> str:
    """Why, once: a rewriter's refusal with the file and the anchor it names; else the structured
    reason where there is one, without the spec's file that the report names itself."""
    from surgeon.patch.recipes import PatchApplicationError

    if isinstance(e, PatchApplicationError):
        return str(e)
    text = getattr(e, "reason", None) or str(e)
    return text.removeprefix(f"{inp.spec.file}: ")


# ---------------------------------------------------------------------------------------------
# 1. the serving config alone
# ---------------------------------------------------------------------------------------------
def config_route(inp: PlanInput, needs: Sequence[str]) -> RoutePlan:
    """What ``surgeon render`` gives: the draft config's ids make the engine feed the draft's fc."""
    from surgeon.wiring.render import render

    rp = RoutePlan("config", TITLES["config"], {})
    if "dump" in needs:
        rp.verdicts["dump"] = Verdict(False, "a serving config feeds the draft and writes no dump")
    if "serve" not in needs:
        return rp
    try:
        r = render(inp.spec, inp.engine, engine_root=inp.engine_root)
    except BadInput as e:
        rp.verdicts["serve"] = Verdict(False, _reason(inp, e))
        return rp
    captured = [c.captured or "never captured" for c in r.captures]
    wanted = [c.point for c in r.captures]
    if captured != wanted:
        rp.verdicts["serve"] = Verdict(False, f"the ids {r.ids} capture {captured}, the spec needs {wanted}", r.ids,
                                       captured)
    elif not r.verified:
        rp.verdicts["serve"] = Verdict(None, f"undecided: {r.unverified_reason}", r.ids, captured)
    else:
        rp.verdicts["serve"] = Verdict(True, f"the draft config's ids {r.ids} capture {', '.join(wanted)} "
                                             f"({r.convention})", r.ids, captured)
    rp.launch = engine_launch(inp.engine, r.launch_flags)
    rp.config = {"draft_config": r.draft_config}
    rp.evidence = list(r.evidence) + list(r.notes)
    if inp.pp > 1:
        _pipeline(inp, rp, "serve", inp.spec.fc_points)
    return rp


def _pipeline(inp: PlanInput, rp: RoutePlan, need: str, points: Sequence[Point]) -> None:
    """``--pp N``: where each point's pipeline stage is and whether its state reaches the draft
    (:mod:`surgeon.engines.probes.pipeline`); a point that does not reach refuses the need, one not
    read makes it undecided."""
    from surgeon.engines.probes.pipeline import lint_pipeline
    from surgeon.engines.view import model_class_for, open_engine

    v = rp.verdicts[need]
    view = open_engine(inp.engine, inp.engine_root) if inp.engine != "trtllm" else None
    if view is None or view.probe is None:
        rp.verdicts[need] = Verdict(None if v.ok else v.ok, f"{v.why}; pp {inp.pp}: not checked ({inp.engine} not read "
                                                            "here)", v.ids, v.captures)
        return
    cc = view.class_convention(model_class_for(inp.spec, inp.engine))
    _, checked, answer = lint_pipeline(inp.spec, inp.engine, view.probe.root, view.probe.version, cc, inp.pp, 1,
                                       strict=True)
    rp.hazards.extend(c for c in checked if "pp" in c)
    if answer is None or not v.ok:
        return
    wanted = {str(p) for p in points}
    if answer.refused:
        rp.verdicts[need] = Verdict(False, f"pp {inp.pp}: {answer.refused}", v.ids, v.captures)
    elif lost := [p for p in answer.placements if p.point in wanted and p.reaches is False]:
        rp.verdicts[need] = Verdict(False, f"pp {inp.pp}: " + "; ".join(f"{p.point}: {p.why}" for p in lost),
                                    v.ids, v.captures)
    elif answer.unverified or any(p.reaches is None for p in answer.placements if p.point in wanted):
        rp.verdicts[need] = Verdict(None, f"undecided: pp {inp.pp}: {answer.unverified or 'a stage not read'}",
                                    v.ids, v.captures)


# ---------------------------------------------------------------------------------------------
# 2. the native capture path
# ---------------------------------------------------------------------------------------------
def native_route(inp: PlanInput, needs: Sequence[str]) -> RoutePlan:
    if inp.engine == "trtllm":
        return trtllm_native(inp, needs)
    return engine_native(inp, needs)


# ---------------------------------------------------------------------------------------------
# 3 and 4. surgeon's patch, as a plugin or on disk
# ---------------------------------------------------------------------------------------------
def plugin_route(inp: PlanInput, needs: Sequence[str]) -> RoutePlan:
    """The patch, carried by an engine plugin: expresses what the patch expresses, where the release
    has a plugin loader (read from its source) and surgeon can build the plugin for it."""
    from surgeon.engines.probes.native import read_route_facts

    if inp.engine == "trtllm":
        return RoutePlan("plugin", TITLES["plugin"], refused(_NO_TRTLLM_SOURCE, needs))
    loader = read_route_facts(inp.engine, inp.engine_root).plugin
    if not loader.available:
        return RoutePlan("plugin", TITLES["plugin"], refused(loader.reason, needs))
    if (why := _plugin_refusal(inp)) is not None:
        return RoutePlan("plugin", TITLES["plugin"], refused(why, needs))
    rp = _patched("plugin", inp, needs)
    where = f" ({loader.cite.where})" if loader.cite else ""
    rp.evidence.insert(0, f"{loader.name}{where}: {loader.reason}")
    modes = [mode for need, mode in (("serve", "aux"), ("dump", "dump")) if need in needs and rp.verdicts[need].ok]
    rp.steps = [f"surgeon apply {inp.spec.file} --engine {inp.engine} --deliver plugin --mode {mode} -o <PLUGIN_DIR>"
                + (" (one plugin per mode, one installed at a time)" if len(modes) > 1 else "") for mode in modes]
    rp.steps.append("pip install <PLUGIN_DIR> in the engine's environment (or put <PLUGIN_DIR> on its PYTHONPATH)")
    if loader.errors:
        rp.hazards.append(f"{loader.name}: {loader.errors}")
    return rp


def _plugin_refusal(inp: PlanInput) -> str | None:
    from surgeon.patch.plugin import delivery_refusal

    return delivery_refusal(inp.engine, inp.engine_root)


def patch_route(inp: PlanInput, needs: Sequence[str]) -> RoutePlan:
    if inp.engine == "trtllm":
        return RoutePlan("patch", TITLES["patch"], refused(_NO_TRTLLM_SOURCE, needs))
    rp = _patched("patch", inp, needs)
    guard = " --guard-bypass" if any("--guard-bypass" in h for h in rp.hazards) else ""
    rp.steps = [f"surgeon apply {inp.spec.file} --engine {inp.engine}{guard} --mode {mode}"
                for need, mode in (("serve", "aux"), ("dump", "dump")) if need in needs and rp.verdicts[need].ok]
    rp.hazards.append("writes the engine's model file in place: a read-only site-packages or image refuses it, "
                      "and every host and image needs the same apply (the plugin route carries the patch instead)")
    return rp


def _patched(route: str, inp: PlanInput, needs: Sequence[str]) -> RoutePlan:
    """The patch planner's answer per need (``aux`` mode feeds the draft, ``dump`` mode writes the
    dump), computed from the pristine files: nothing is written."""
    rp = RoutePlan(route, TITLES[route], {})
    for need in needs:
        mode: Literal["aux", "dump"] = "aux" if need == "serve" else "dump"
        p, bypass = _patch_plan(inp, mode)
        if isinstance(p, BadInput):
            rp.verdicts[need] = Verdict(False, _reason(inp, p))
            continue
        where = f"{p.model_file}" + (f" ({p.loop_class})" if p.loop_class else "")
        rp.verdicts[need] = Verdict(True, f"{mode} hooks at the residual-stream sites of {where}: "
                                          f"{', '.join(inp.needs[need])}"
                                          + (" (with --guard-bypass)" if bypass else ""))
        rp.evidence.append(f"{need}: rewrites {where}, generates {p.hooks_file}")
        if bypass and bypass not in rp.hazards:
            rp.hazards.append(bypass)
    rp.launch = engine_launch(inp.engine, [])
    if "serve" in needs and inp.engine == "vllm":
        rp.config = {"speculative_config": {"method": "eagle3", "model": "<DRAFT>", "num_speculative_tokens": 3}}
    if inp.pp > 1:
        _patched_pp(inp, rp)
    return rp


def _patch_plan(inp: PlanInput, mode: Literal["aux", "dump"]):
    """The patch planner's plan for ``mode`` (or its refusal), once per plan. Where the only refusal
    is a path that runs decoder layers outside the capture loop (SGLang's two-batch overlap), the
    plan with ``--guard-bypass``, whose runtime guard raises rather than let a captured layer run
    uncaptured: returned with that hazard (None otherwise)."""
    from surgeon.patch.apply import plan_patch
    from surgeon.patch.recipes import PatchApplicationError

    key = ("patch", mode)
    if key not in inp.memo:
        def attempt(guard: bool):
            try:
                return plan_patch(inp.spec, engine=inp.engine, engine_root=inp.engine_root, mode=mode,
                                  guard_bypass=guard)
            except BadInput as e:
                return e

        first = attempt(False)
        hazard = None
        if isinstance(first, PatchApplicationError) and ":bypass" in first.anchor:
            guarded = attempt(True)
            if isinstance(guarded, BadInput):  # refused for another reason as well: that one decides
                first = guarded
            else:
                hazard = (f"needs `surgeon apply --guard-bypass`: {first.relpath}: {first.anchor}: {first.reason}; the "
                          "guard raises at run time if that path would run a captured layer (serve without it, e.g. "
                          "SGLang without --enable-two-batch-overlap)")
                first = guarded
        inp.memo[key] = (first, hazard)
    return inp.memo[key]


def _patched_pp(inp: PlanInput, rp: RoutePlan) -> None:
    """``--pp N`` for the hooks (surgeon/capture/hooks.py's contract): in dump mode each rank drains
    the slots of its own layers (a hazard: one file per rank to join); in aux mode the rank that runs
    the draft must hold every fc slot, so an fc point on an earlier stage refuses the serve need."""
    from surgeon.engines.probes.pipeline import PipelineUnread, partition
    from surgeon.engines.view import open_engine

    if "dump" in rp.verdicts and rp.verdicts["dump"].ok:
        rp.hazards.append(f"pp {inp.pp}: each pipeline rank writes the dump slots of its own layers: one dump per rank")
    v = rp.verdicts.get("serve")
    if v is None or not v.ok:
        return
    view = open_engine(inp.engine, inp.engine_root)
    try:
        if view.probe is None:
            raise PipelineUnread(f"{inp.engine} is not read here")
        stages, where = partition(inp.engine, view.probe.root, inp.spec.num_layers, inp.pp)
    except PipelineUnread as e:
        rp.verdicts["serve"] = Verdict(None, f"undecided: pp {inp.pp}: {e}")
        return
    start = stages[-1][0]
    early = [str(p) for p in inp.spec.fc_points if p.position is not None and p.position - 1 < start]
    if early:
        rp.verdicts["serve"] = Verdict(False, f"pp {inp.pp}: aux hooks hand the draft every fc slot from the last "
                                              f"stage's rank, which runs layers {start}..{stages[-1][1] - 1} ({where}); "
                                              f"{', '.join(early)} are captured on earlier ranks")
