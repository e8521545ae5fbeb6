"""The ``--json`` output model of ``upgrade-check``: per spec its ids on both releases and the
verdict on its deployed draft config, then every change in a class's meaning or in what the model
runner reads, each with file:line on both sides (paths relative to that release's root)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from surgeon.commands.outputs.base import _Output
from surgeon.core.shapes import Closed, Point


class UpgradeRelease(Closed):
    engine: str
    version: str
    root: str = Field(description="the package directory read (never imported)")


class UpgradeChange(Closed):
    subject: str = Field(description="the class (its name, or path:Class where names repeat), or 'runner'")
    aspect: str = Field(description="class, status, id rule, default, order, capture sites, verified; "
                                    "runner: verdict, setter call, draft-config key")
    before: str | None = Field(description="as the old release reads it; null: absent there")
    after: str | None = Field(description="as the new release reads it; null: absent there")
    before_at: list[str] = Field(description="file:line in the old release")
    after_at: list[str] = Field(description="file:line in the new release")


class UpgradeClass(Closed):
    class_name: str
    in_specs: bool = Field(description="a spec's model class")
    changes: list[UpgradeChange]


class UpgradeSpec(Closed):
    spec: str
    file: str
    model_class: str
    before: list[int] | None = Field(description="the ids the old release renders; null: refused (refused_before)")
    after: list[int] | None = Field(description="the ids the new release renders; null: refused (refused_after)")
    refused_before: str | None
    refused_after: str | None
    deployed: dict[str, Any] | None = Field(description="the draft-config fragment the old release renders: "
                                                        "what is deployed, checked on the new release")
    served: Literal["same", "differently", "undecided", "not_deployed"] = Field(
        description="the deployed config on the new release: same, differently (exit 3), undecided (exit 4: "
                    "code not read), not_deployed (the old release refuses the spec)")
    captured_before: list[Point | None] = Field(description="what the deployed config captures on the old release")
    captured_after: list[Point | None] = Field(description="what it captures on the new release")
    reasons: list[str] = Field(description="why differently, undecided or not deployed, with file:line")
    evidence_before: list[str]
    evidence_after: list[str]


class UpgradeCheckOutput(_Output):
    ok: bool = Field(description="no spec is served differently or undecided (exit 0)")
    changed: bool = Field(description="anything differs: ids, a verdict, a class or the runner")
    served_differently: list[str] = Field(description="specs whose deployed config the new release serves otherwise")
    undecided: list[str] = Field(description="specs whose verdict rests on code not read (exit 4 when none differs)")
    before: UpgradeRelease
    after: UpgradeRelease
    engine: str
    platform: str
    specs: list[UpgradeSpec]
    classes: list[UpgradeClass] = Field(description="classes whose meaning changed: the specs' first")
    runner: list[UpgradeChange]
    classes_compared: int
