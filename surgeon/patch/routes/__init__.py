"""`surgeon plan`: every route that gets a spec's hidden states out of one engine release, in order
of least intrusion, each judged against the release's own source, and the first that works.

The data (needs, verdicts, routes) is :mod:`surgeon.patch.routes.model`; the judges are
:mod:`surgeon.patch.routes.judges` (the serving config, the plugin, the on-disk patch) and
:mod:`surgeon.patch.routes.native` (the engine's own capture path).
"""

from __future__ import annotations

from contextlib import nullcontext

from surgeon.core.errors import BadInput
from surgeon.core.spec import Spec
from surgeon.engines.view import platform_scope
from surgeon.patch.routes.judges import judge, release_of
from surgeon.patch.routes.model import ENGINES, ROUTES, Plan, PlanInput, RoutePlan, Verdict

__all__ = ["ENGINES", "ROUTES", "Plan", "PlanInput", "RoutePlan", "Verdict", "plan"]


def plan(spec: Spec, engine: str, *, engine_root=None, platform: str | None = None, pp: int = 1,
         dump_dir: str | None = None) -> Plan:
    """Every route for ``spec`` on ``engine`` (one of :data:`ENGINES`; its installed release, or the
    one at ``engine_root``), judged per need, and the first route that works for each."""
    if engine not in ENGINES:
        raise BadInput(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise BadInput(f"--pp must be a positive integer, not {pp!r}")
    if engine == "trtllm" and engine_root is not None:
        raise BadInput("--engine-root does not apply to trtllm (its answers are a table cited from its GitHub source)")
    inp = PlanInput(spec, engine, engine_root, platform, pp, dump_dir)
    needs = inp.needs
    if not needs:
        raise BadInput(f"{spec.file}: the spec has neither a draft with an fc input nor a dumps section: "
                       "there is nothing to capture for")
    with platform_scope(platform) if platform is not None else nullcontext():
        release, model_class, notes = release_of(inp)
        routes = [judge(route, inp, needs) for route in ROUTES]
    recommended = {need: next((r.route for r in routes if r.verdicts[need].ok is True), None) for need in needs}
    return Plan(spec.name, spec.file, engine, release, platform, pp, model_class, needs, routes, recommended, notes)


