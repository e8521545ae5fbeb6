"""The ``--json`` output models of drafts: demo, infer-wiring, accept.

The demo nests the infer-wiring and accept outputs of its draft step without a format of their
own (:class:`InferWiring`, :class:`Accept`), in its ``draft`` object (:class:`DemoDraftStep`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from surgeon.commands.outputs.base import _Output
from surgeon.commands.outputs.harness import MatchResult
from surgeon.core.shapes import Closed, Finite, PathText, Point, Real, Timings


def _blank_none(value: Any) -> Any:
    return value or None


#: A text that is ``null`` where the result holds an empty one.
BlankNone = Annotated[str | None, BeforeValidator(_blank_none)]


class InferSlot(Closed):
    slot: int
    point: Point
    score: Real = Field(description="alignment of the fc slot's amplification W_j^T W_j (isotropic part removed) "
                                     "with this point's state covariance; relative to its slot")
    runner_up: Point | None
    runner_up_score: Finite
    margin: Finite = Field(description="(score - runner_up_score) / score; null when nothing aligns")
    decides: bool = Field(description="the margin is wide enough and the decided behaviour signal does not contradict it")
    contradicted: bool = Field(description="the decided behaviour signal names another point for this slot")


class InferWeightSpace(Closed):
    wiring: list[Point]
    margin: Finite = Field(description="the smallest slot margin")
    decides: bool
    slots: list[InferSlot]


class InferBehaviour(Closed):
    wiring: list[Point]
    steps: int = Field(description="chained draft steps the divergence sums over")
    divergence: Finite = Field(description="KL from the target's next-token distribution to the draft's, nats per "
                                                 "position summed over the chained steps, mean over prompts (searched)")
    agreement: Finite = Field(description="step-1 top-1 agreement with the target's greedy next token (reported)")
    runner_up: list[Point] | None
    runner_up_divergence: Finite
    runner_up_agreement: Finite
    margin: Finite = Field(description="the runner-up's divergence minus the chosen wiring's (nats)")
    z: Finite = Field(description="margin over the standard error of the per-prompt differences (null: one prompt)")
    decides: bool | None
    evaluations: int


class InferCandidate(Closed):
    label: str
    wiring: list[Point]
    weight_score: Real = Field(description="mean over slots of the alignment relative to the slot's best (1: every slot's best)")
    agreement: Finite
    divergence: Finite


class InferIds(Closed):
    ids: list[int] | None
    error: str | None = Field(description="why there are no ids, the reason alone (null: ids given)")
    origin: BlankNone
    kind: Literal["not_expressible", "refused"] | None = Field(
        default=None, description="null: ids given; not_expressible: the target's convention cannot name the "
                                  "wiring; refused: the target cannot serve it or cannot be read here")


class InferStatedEngine(Closed):
    engine: str
    agrees: bool | None = Field(description="null: not checked (see problems)")
    reads: list[int] | None
    captures: list[Point | None]
    problems: list[str]


class InferStated(Closed):
    ids: dict[str, list[int]] = Field(description="config key -> ids as written")
    agree: bool | None
    engines: list[InferStatedEngine]


class InferWiring(Closed):
    ok: bool = Field(description="false when the draft config states no ids, or ids that disagree with a decided wiring "
                                 "(exit 3), or when the evidence does not decide the wiring (exit 4)")
    headline: str = Field(description="the report's first line: decided or undecided, and what the stated ids say")
    draft: str
    fc_tensor: str
    target: str
    num_layers: int
    hidden_size: int
    n_slots: int
    tokens: int
    wiring: list[Point] = Field(description="the inferred fc input, in slot order")
    decided: bool = Field(description="the behaviour signal (chained divergence, paired over prompts) decides; "
                                      "weight-space evidence alone never does")
    weight_space: InferWeightSpace
    behaviour: InferBehaviour | None
    candidates: list[InferCandidate]
    ids: dict[str, InferIds]
    stated: InferStated
    spec: str = Field(description="spec v1 text of the inferred wiring")
    written: str | None
    notes: list[str]


class InferWiringOutput(InferWiring, _Output):
    pass


class AcceptWiring(Closed):
    name: str
    why: str
    points: list[str | None] = Field(description="the point fed to each fc slot; null: never captured")
    note: str | None
    not_servable: str | None = Field(description="why this wiring cannot run at all (null: it runs)")
    per_position: list[Real] | None = Field(description="P(accepted > j) for draft position j = 0..K-1")
    expected_accepted: Finite = Field(description="expected accepted draft tokens per chain")
    accept_length: Finite = Field(description="1 + expected_accepted: the target's bonus token counted")
    chains: int
    divergence: Finite = Field(description="KL from the target's next-token distribution to the draft's, nats "
                                                 "per chain summed over its K steps (null: not measured)")


class Accept(Closed):
    ok: bool = Field(description="exit 0: the spec's position-1 acceptance is at least --min and ahead of every other "
                                 "wiring (exit 3 below --min, not servable or behind one; 4 when one is within noise)")
    verdict: Literal["separated", "undecided", "better", "not_run"] = Field(
        description="separated: the spec's wiring accepts more than every other at position 1 by 2 standard errors; "
                    "undecided: one accepts as much within them; better: one accepts more by them")
    headline: str = Field(description="the report's first line: the verdict and the wirings it rests on")
    spec: str
    draft: str
    target: str
    steps: int
    prompts: str = Field(description="where the prompts came from: the seeded rule or the file")
    n_prompts: int
    length: int
    min: Finite
    draft_info: dict[str, Any]
    sampling: str
    wirings: list[AcceptWiring] = Field(description="the spec's wiring first, then the miswirings")
    notes: list[str]
    timings_s: dict[str, Real]


class AcceptOutput(Accept, _Output):
    pass


class DemoDraftStep(Closed):
    """The demo's draft step (surgeon.draft.demo.DraftDemo), printed as the demo's ``draft`` object."""

    ok: bool
    target: PathText
    draft: PathText
    trained_on: list[Point]
    spec: PathText
    prompts: PathText
    drop: Finite
    infer_wiring: InferWiring
    accept: Accept
    timings_s: Timings


def _draft_step(value: Any) -> Any:
    return None if value is None else DemoDraftStep.model_validate(value, from_attributes=True).model_dump(mode="json")


#: The draft step, read through :class:`DemoDraftStep` (the schema leaves its keys open).
DraftStep = Annotated[dict[str, Any] | None, BeforeValidator(_draft_step)]


class DemoOutput(_Output):
    ok: bool = Field(description="the spec's wiring verified, the mis-wiring was caught, the revert is byte-identical, "
                                 "and the draft step named its trained wiring")
    workdir: PathText
    model: PathText
    spec: PathText
    wrong_spec: PathText
    reference: PathText
    dump: PathText
    heatmap: PathText
    heatmap_right: PathText
    engine_root: PathText
    model_file: str
    route: Literal["plugin", "patch"] = Field(description="the route `surgeon plan` recommended for the dump and the "
                                                          "demo took: the plugin (the engine only read) or the patch "
                                                          "on disk (reverted)")
    reverted_byte_identical: bool = Field(description="the engine's model file is byte-identical after the run "
                                                      "(reverted, or never written by the plugin)")
    right: MatchResult | None
    wrong: MatchResult | None
    draft: DraftStep = Field(description="the draft step (surgeon.draft.demo): ok, trained_on, drop, and "
                                                     "the infer-wiring and accept outputs")
    timings_s: Timings
