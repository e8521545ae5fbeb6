"""The ``--json`` output models of specs: lint, explain, render, check-draft, review, conventions.

Each model reads its result's attributes of the same names (``from_attributes``). Where the probe's
attribute has another form than its JSON (a method, a count of a list, a rule object printed by its
name), a value type below converts it; the ``dict[str, Any]`` parts of ``conventions`` (the runner,
the per-platform dispatch) are filled through private models that declare their keys."""

from __future__ import annotations

from collections.abc import Callable, Sized
from dataclasses import asdict, is_dataclass
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from surgeon.commands.outputs.base import _Output
from surgeon.core.shapes import Closed, Point


def _called(value: Any) -> Any:
    """A method of the result read as what it returns (``EngineProbe.coverage()``, ``ArchDispatch.text()``)."""
    return value() if callable(value) else value


def _count(value: Any) -> Any:
    """A collection read as how many it holds (``EngineProbe.classified``)."""
    return len(value) if isinstance(value, Sized) and not isinstance(value, str) else value


def _named(value: Any) -> Any:
    """A rule object read as its name (``ClassConvention.id_rule``: ``IdRule.name``)."""
    return getattr(value, "name", value)


def _texts(value: Any) -> Any:
    """A list of terms read as their texts (``ClassConvention.default``: ``L//2``, ``2``)."""
    return None if value is None else [str(t) for t in value]


def _records(value: Any) -> Any:
    """Plain records (dataclasses whose fields are the JSON keys) read as dicts."""
    return None if value is None else [asdict(r) if is_dataclass(r) and not isinstance(r, type) else r for r in value]


def _by_place(value: Any) -> Any:
    """Probed classes (by key) listed in file order."""
    return sorted(value.values(), key=lambda c: (c.path, c.line)) if isinstance(value, dict) else value


def _through(model: type[Closed]) -> Callable[[Any], Any]:
    """An object read through a private model into the plain dict a loosely typed field holds."""
    def convert(value: Any) -> Any:
        if value is None or isinstance(value, dict):
            return value
        return model.model_validate(value, from_attributes=True).model_dump(mode="json")
    return convert


class Issue(Closed):
    file: str
    line: int = Field(description="1-based; 0 when the issue has no place in the file")
    col: int
    severity: Literal["error", "warning"]
    path: str = Field(description="dotted key path in the spec, e.g. captures.low; empty for the whole spec")
    message: str


class StagePlacement(Closed):
    point: Point
    position: int | None = Field(description="capture index (stream position); null: not captured")
    stage: int | None = Field(description="0-based pipeline stage whose loop captures it; null: never captured")
    layer: int | None = Field(description="the layer whose iteration captures it; null: before or after the loop")
    reaches: bool | None = Field(description="it reaches the draft on the last stage; null: not verified")
    why: str = Field(description="the capture site and the forwarding rule read, file:line")


class PipelineCheck(Closed):
    engine: str
    release: str
    pp: int
    tp: int
    stages: list[list[int]] = Field(description="[start, end) layers of each stage, from the release's partition")
    partition: str = Field(description="file:line of the partition function evaluated, and what was assumed")
    placements: list[StagePlacement]
    refused: str | None = Field(description="the engine refuses this draft with pipeline parallelism (file:line)")
    unverified: str | None
    notes: list[str]


class LintedSpec(Closed):
    file: str
    ok: bool
    checked: list[str] = Field(description="what was checked and passed, one line each")
    issues: list[Issue]
    pipeline: list[PipelineCheck] = Field(default_factory=list, description="`lint --pp`: one per engine checked")


class LintOutput(_Output):
    ok: bool = Field(description="every spec is valid (warnings allowed); exit 2 otherwise")
    specs: list[LintedSpec]


class IdList(Closed):
    convention: str
    origin: str = Field(description="where the rule was read: a probe of the engine source, or the built-in table")
    ids: list[int] | None = Field(description="null: not expressible (see error)")
    error: str | None
    captures: list[Point] = Field(description="what the ids capture, replayed through the engine's setter")
    kind: Literal["not_expressible", "refused"] | None = Field(
        default=None, description="null: ids given; not_expressible: the convention cannot name the points; "
                                  "refused: the target cannot serve them or cannot be read here")


class ExplainRow(Closed):
    name: str
    point: Point
    fc_slot: int | None
    dump_slot: str | None
    ids: dict[str, int | str] = Field(description="convention -> id, or 'not expressible: why'")


class ExplainOutput(_Output):
    spec: str
    file: str
    sha256: str
    num_layers: int
    hidden_size: int
    conventions: dict[str, str] = Field(description="column -> the convention's rule and where it was read")
    rows: list[ExplainRow]
    fc_lists: dict[str, IdList]
    notes: list[str]


class RenderedCapture(Closed):
    fc_slot: int
    name: str
    point: Point
    captured: Point | None = Field(description="what the rendered ids capture, replayed")
    site: str | None = Field(default=None, description="file:line of the capture site the engine uses for this slot")
    verified: bool | None = Field(default=None, description="false when that site's value was not read")


class Launch(Closed):
    argv: list[str] = Field(description="the launch flags, one argument per item (<DRAFT>: the draft's path)")
    shell: str = Field(description="the same, quoted for a POSIX shell (shlex.join)")


class RenderOutput(_Output):
    spec: str
    target: Literal["sglang", "vllm", "specforge", "speculators", "trtllm", "modelopt-hf", "modelopt-trtllm",
                    "modelopt-vllm", "zlab"]
    model_class: str | None
    convention: str
    origin: str
    ids: list[int]
    captures: list[RenderedCapture]
    draft_config: dict[str, Any] = Field(description="the fragment to merge into the draft's config.json "
                                         "(trtllm: the LLM API options; modelopt-*: empty, its flags carry the ids)")
    launch: Launch
    dump: dict[str, Any] | None = Field(description="the dump layout the target reads, where it has one")
    notes: list[str]
    verified: bool = Field(default=True, description="false when the answer rests on engine code the probe did not read")
    unverified_reason: str | None = None
    evidence: list[str] = Field(default_factory=list, description="file:line of the setter, loop, capture sites, runner")
    platform: str | None = Field(default=None, description="the platform the engine answer holds for (all: no dispatch)")


class DraftFinding(Closed):
    severity: Literal["error", "warning", "info"]
    kind: str
    detail: str


class DraftNorm(Closed):
    flag: Literal["norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"]
    state: Literal["used", "read_unused", "not_read", "unverified"] = Field(
        description="what the engine's draft model file does with the flag: used (a use site found), read_unused (read, "
                    "its value used nowhere: treated as not read), not_read, unverified (the value escapes to code not read)")
    read: str | None = Field(description="file:line of the read the state rests on")
    used_at: str | None = Field(description="used: file:line where the value changes the computation")
    builds: bool = Field(description="the value the engine builds the draft with")
    needs: bool = Field(description="the value the draft was trained with")
    detail: str


class DraftRunner(Closed):
    runner: str = Field(description="vLLM's model runner (V1 or V2) whose setter call the probe read")
    call: str = Field(description="file:line of its setter call")
    chosen: str = Field(description="when vLLM runs it, with the file:line that decides")
    key: str | None = Field(description="the draft-config key its ids came from (+N: added to each); null: none, the default")
    read_at: str | None = Field(description="file:line of that read")
    ids: list[int] | None = Field(description="what it passes to the setter; null: the model's default")
    captured: list[Point | None] | None = Field(description="what those ids make the model capture, in fc order")


class CheckDraftOutput(_Output):
    ok: bool = Field(description="no error finding: the engine feeds the fc the spec's points; exit 3 otherwise")
    spec: str
    draft: str
    engine: str
    model_class: str | None
    origin: str
    config_rule: str
    ids_found: dict[str, Any] = Field(description="where in the config -> the ids there")
    ids_used: list[int] | None = Field(description="what the engine passes to its setter; null: its default")
    captured: list[Point | None]
    expected: list[Point]
    fc_weight: dict[str, Any] | None
    findings: list[DraftFinding]
    norms: list[DraftNorm] = Field(default_factory=list, description="EAGLE-3 drafts, per norm flag: what the engine does "
                                   "with it (empty: not read for this engine)")
    runners: list[DraftRunner] = Field(default_factory=list, description="vllm, speculators: what each model runner "
                                       "the probe read serves for this config (ids_used/captured: V1's)")


class ReviewCapture(Closed):
    name: str
    was: Point | None
    now: Point | None


class ReviewIds(Closed):
    target: str
    before: list[int] | None
    after: list[int] | None


class ReviewOutput(_Output):
    old: str
    new: str
    fc_changed: bool = Field(description="the draft's fc input changed physically")
    captures: list[ReviewCapture]
    ids: list[ReviewIds]
    markdown: str = Field(description="the pull-request comment (GitHub-flavoured Markdown)")


class CoverageCounts(Closed):
    total: int
    classified: int
    no_capture: int
    delegates: int = Field(default=0, description="classes handing the ids to a text model the checkpoint picks")
    unclassified: int


class ProbedBypass(Closed):
    line: int
    description: str
    layers: str
    path: str | None


class ProbedClass(Closed):
    engine: str
    path: str
    class_name: str
    line: int
    status: Literal["classified", "unclassified"]
    reason: str | None
    setter: str | None
    setter_owner: str | None
    id_rule: Annotated[str | None, BeforeValidator(_named)]
    default: Annotated[list[str] | None, BeforeValidator(_texts)]
    default_through_rule: bool
    sorts: bool
    dedups: bool
    emit_order: str
    capture_site: str
    captured_value: str
    loop_owner: str | None
    bypasses: list[ProbedBypass]
    tail_capture: bool
    no_capture: bool
    delegates: bool = False
    # the capture sites read and whether the answer is verified: keys added after format 1 was fixed,
    # so optional in the schema (older outputs still validate)
    sites: Annotated[list[dict[str, Any]] | None, BeforeValidator(_records)] = None
    verified: bool | None = None
    unverified_reason: str | None = None
    evidence: Annotated[list[dict[str, Any]] | None, BeforeValidator(_records)] = None


# -- the keys of conventions' loosely typed parts (not in its schema: `dict[str, Any]` there) ----------
class _IdSource(Closed):
    key: str
    offset: int
    path: str
    line: int
    when: str | None
    origin: Literal["draft_config", "engine"]


class _RunnerCall(Closed):
    path: str
    line: int
    function: str
    setter: str
    passes: str
    default_method: str | None
    sources: list[_IdSource]
    detail: str | None


class _Runner(Closed):
    """``runner``: every setter call read in the release's model runner, and what they add up to."""

    engine: str
    version: str
    files: list[str]
    calls: list[_RunnerCall]
    verified: bool
    reason: str | None
    graph_default: str | None
    ignores_draft_ids: bool


class _PlatformTarget(Closed):
    platform: str
    path: str | None
    class_name: str
    line: int
    evidence: str
    verified: bool
    reason: str | None
    convention: str | None


class _ArchDispatch(Closed):
    """``dispatch``: per registered architecture, what runs on each platform."""

    architecture: str
    module: str
    platform: str
    targets: list[_PlatformTarget]
    disagree: str | None
    text: Annotated[str, BeforeValidator(_called)]


def _dispatch_by_arch(value: Any) -> Any:
    """Per registered architecture, sorted, what runs on each platform."""
    if not isinstance(value, dict):
        return value
    convert = _through(_ArchDispatch)
    return {a: convert(d) for a, d in sorted(value.items())}


class ConventionsOutput(_Output):
    coverage: Annotated[dict[str, CoverageCounts], BeforeValidator(_called)]
    engine: str
    version: str
    root: str
    files_scanned: int
    classified: Annotated[int, BeforeValidator(_count)]
    unclassified: Annotated[int, BeforeValidator(_count)]
    architectures: dict[str, str] = Field(description="registered architecture -> probed class")
    registered: dict[str, str] = Field(default_factory=dict,
                                       description="registered architecture without a capture interface -> path:line class")
    classes: Annotated[list[ProbedClass], BeforeValidator(_by_place)]
    # the platform answered for, per-platform dispatch, the runner read: keys added after format 1 was
    # fixed, so optional in the schema (older outputs still validate)
    platform: str | None = None
    dispatch: Annotated[dict[str, Any] | None, BeforeValidator(_dispatch_by_arch)] = None
    runner: Annotated[dict[str, Any] | None, BeforeValidator(_through(_Runner))] = None
    unreadable: dict[str, str] | None = Field(
        default=None, description="model file -> why surgeon's reader could not handle it (its classes are not "
                                  "answered; every other file's are); added after format 1, always printed")

