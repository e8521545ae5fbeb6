"""The ``--json`` output model of ``plan``: every capture route for one spec on one engine release,
least intrusive first, each judged per need (serve: the draft's fc input; dump: the spec's dump
slots), with the launch to paste, the hazards the release's source shows and its file:line."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from surgeon.commands.outputs.base import _Output
from surgeon.core.shapes import Closed

Need = Literal["serve", "dump"]


class PlanVerdict(Closed):
    ok: bool | None = Field(description="true: the route captures exactly the declared points; false: refused; "
                                         "null: undecided (it rests on engine code not read)")
    state: Literal["works", "refused", "undecided"]
    why: str = Field(description="one line, with file:line of the check where the release's source has one")
    ids: list[int] | None = Field(description="the ids the route hands the engine; null where it takes none")
    captures: list[str] = Field(description="what those ids capture, in the order the engine delivers or writes them")
    names: list[str] = Field(description="the spec's capture name of each of those, where the route writes a dump")


class PlanRoute(Closed):
    route: Literal["config", "native", "plugin", "patch"]
    title: str
    verdicts: dict[Need, PlanVerdict]
    launch: list[str] = Field(description="the engine's launch, one argument per item (<MODEL>, <DRAFT>, "
                                          "<DUMP_DIR>: placeholders)")
    launch_shell: str = Field(description="the same, quoted for a POSIX shell")
    config: dict[str, Any] = Field(description="the JSON the launch carries, by name (draft_config: the fragment "
                                               "of the draft's config.json)")
    steps: list[str] = Field(description="what to run before the launch")
    hazards: list[str] = Field(description="what the release's source shows endangering the route, with file:line "
                                           "(or the public thread, marked as not read)")
    evidence: list[str]
    labels: list[str] = Field(description="how match, verify, audit and export read what the route writes")


class PlanOutput(_Output):
    ok: bool = Field(description="every need has a route that works (exit 0; 3 where every route refuses a need, "
                                 "4 where the rest is undecided)")
    spec: str
    file: str
    engine: Literal["vllm", "sglang", "trtllm"]
    release: str | None = Field(description="the engine version read; null for trtllm (a cited table)")
    platform: str | None
    pp: int
    model_class: str | None
    needs: dict[Need, list[str]] = Field(description="each need and the points it asks for")
    recommended: dict[Need, Literal["config", "native", "plugin", "patch"] | None] = Field(
        description="per need, the first route that works; null: none does")
    routes: list[PlanRoute] = Field(description="config, native, plugin, patch: least intrusive first")
    notes: list[str]
    sidecar: str | None = Field(description="the sidecar `--dump-dir` wrote for the native route; null: none written")
