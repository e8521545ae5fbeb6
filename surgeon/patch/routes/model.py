"""The data of `surgeon plan` (:mod:`surgeon.patch.routes`): needs, verdicts, routes.

Two needs, judged separately, because no route meets both everywhere:

* ``serve``: the draft's fc receives the spec's ``fc_input`` points (a spec with an EAGLE-3 or
  DFlash draft);
* ``dump``: the spec's dump slots are written, each a labelled state (a spec with ``dumps``).

The routes, least intrusive first (:data:`ROUTES`):

1. ``config``: the serving config alone: the draft config's ids make the engine capture the fc
   input (what ``surgeon render`` gives). Serves; writes nothing.
2. ``native``: the engine's own capture path (vLLM's ``extract_hidden_states`` method with its
   hidden-state connector, SGLang's ``--enable-return-aux-hidden-states``, TensorRT-LLM's
   ``SaveHiddenStatesDecodingConfig``). Dumps; loads no draft.
3. ``plugin``: surgeon's patch delivered as an engine plugin (vLLM ``vllm.general_plugins``): the
   engine's files stay untouched. Serves and dumps.
4. ``patch``: surgeon's patch written into the engine's model file. Serves and dumps.

Each verdict is ``ok`` True (the route captures exactly the declared points), False (refused: the
reason, with file:line of the check where the release's source has one) or None (undecided: the
answer rests on engine code that was not read). Only a True verdict is recommended.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from surgeon.core.errors import UNDECIDED
from surgeon.core.points import Point
from surgeon.core.spec import Spec

ROUTES = ("config", "native", "plugin", "patch")
TITLES = {
    "config": "the serving config alone",
    "native": "the engine's native capture path",
    "plugin": "surgeon's patch delivered as a plugin",
    "patch": "surgeon's patch on disk",
}
ENGINES = ("vllm", "sglang", "trtllm")
NEEDS_REFUSED = 3  # a need no route meets (exit 3, as a wiring the engine serves otherwise)
MODEL = "<MODEL>"
DUMP_DIR = "<DUMP_DIR>"
_LAUNCH = {
    "vllm": ["vllm", "serve", MODEL],
    "sglang": ["python", "-m", "sglang.launch_server", "--model-path", MODEL],
    "trtllm": ["trtllm-serve", MODEL],
}


@dataclass
class Verdict:
    """Whether one route meets one need: ``ok`` True / False (refused) / None (undecided), why, and
    the ids the route hands the engine with what they capture, in the order they arrive."""

    ok: bool | None
    why: str
    ids: list[int] | None = None
    captures: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # the spec's name of each capture, where the route writes a dump

    @property
    def state(self) -> str:
        return {True: "works", False: "refused", None: "undecided"}[self.ok]


@dataclass
class RoutePlan:
    """One route: its verdict per need, the launch to paste (argv, and the JSON configs it carries),
    the steps before it, the hazards the release's source shows, and the file:line it rests on."""

    route: str
    title: str
    verdicts: dict[str, Verdict]
    launch: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    steps: list[str] = field(default_factory=list)
    hazards: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # how surgeon reads what it writes (sidecar, --slots)

    @property
    def launch_shell(self) -> str:
        """The launch quoted for a POSIX shell, as ``surgeon render`` quotes its own."""
        from surgeon.wiring.render import Launch

        return Launch(self.launch).shell


@dataclass
class Plan:
    spec: str
    file: str
    engine: str
    release: str | None
    platform: str | None
    pp: int
    model_class: str | None
    needs: dict[str, list[str]]  # need -> the points it asks for, in the spec's order
    routes: list[RoutePlan]
    recommended: dict[str, str | None]  # need -> the first route that works there
    notes: list[str] = field(default_factory=list)
    sidecar: str | None = None  # where `plan --dump-dir` wrote the native route's sidecar

    @property
    def ok(self) -> bool:
        return all(r is not None for r in self.recommended.values())

    @property
    def exit_code(self) -> int:
        if self.ok:
            return 0
        open_needs = [n for n, r in self.recommended.items() if r is None]
        if all(any(p.verdicts[n].ok is None for p in self.routes if n in p.verdicts) for n in open_needs):
            return UNDECIDED
        return NEEDS_REFUSED

    def route(self, name: str) -> RoutePlan:
        return next(r for r in self.routes if r.route == name)


@dataclass(frozen=True)
class PlanInput:
    """What every route is judged on: the spec, the engine release (its root: None for the
    installed one), the platform and the pipeline size, and the points of each need."""

    spec: Spec
    engine: str
    engine_root: Any
    platform: str | None
    pp: int
    dump_dir: str | None
    memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)  # answers two routes share

    @property
    def serve_points(self) -> list[Point] | None:
        d = self.spec.model.draft
        return list(self.spec.fc_points) if d is not None and d.kind in ("eagle3", "dflash") else None

    @property
    def dump_points(self) -> list[tuple[str, Point]] | None:
        if self.spec.model.dumps is None:
            return None
        return [(n, self.spec.captures[n]) for n in self.spec.dump_slots]

    @property
    def needs(self) -> dict[str, list[str]]:
        """Each need the spec has and the points it asks for, in the spec's order."""
        needs: dict[str, list[str]] = {}
        if self.serve_points is not None:
            needs["serve"] = [str(p) for p in self.serve_points]
        if self.dump_points is not None:
            needs["dump"] = [str(p) for _, p in self.dump_points]
        return needs


def dumped_json(value: Any) -> str:
    """A JSON value as a launch argument (compact, keys in the order given)."""
    return json.dumps(value, separators=(", ", ": "))


def refused(why: str, needs: Sequence[str]) -> dict[str, Verdict]:
    """The same refusal for every need."""
    return {n: Verdict(False, why) for n in needs}


def engine_launch(engine: str, flags: Sequence[str]) -> list[str]:
    """The engine's launch command with ``flags`` (``<MODEL>``: the target's path)."""
    return [*_LAUNCH[engine], *flags]
