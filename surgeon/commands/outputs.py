"""The shape of every ``--json`` output, as typed models: ``surgeon schema --output NAME`` prints
the JSON Schema generated from them, and the tests validate each command's real output against it.

One model per output (:data:`OUTPUTS`, keyed by CLI verb), each with the ``format`` number of
:data:`surgeon.commands.results.FORMATS`. Objects are closed (``additionalProperties: false``): a
key a command prints is a key documented here, so a new key is added here with the code that
prints it (the format number stays; it changes when a key is removed, renamed or retyped).
Numbers are JSON numbers; a value that is not known or not finite is ``null``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from surgeon.commands.results import FORMATS

Point = str  # a physical point: "embed", "layer_out[k]", "layer_delta[k]", "final_norm"


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Output(_Closed):
    format: int = Field(description="format number of this output; changes when a key is removed, renamed or retyped")


# -- specs -----------------------------------------------------------------------------------------
class Issue(_Closed):
    file: str
    line: int = Field(description="1-based; 0 when the issue has no place in the file")
    col: int
    severity: Literal["error", "warning"]
    path: str = Field(description="dotted key path in the spec, e.g. captures.low; empty for the whole spec")
    message: str


class StagePlacement(_Closed):
    point: Point
    position: int | None = Field(description="capture index (stream position); null: not captured")
    stage: int | None = Field(description="0-based pipeline stage whose loop captures it; null: never captured")
    layer: int | None = Field(description="the layer whose iteration captures it; null: before or after the loop")
    reaches: bool | None = Field(description="it reaches the draft on the last stage; null: not verified")
    why: str = Field(description="the capture site and the forwarding rule read, file:line")


class PipelineCheck(_Closed):
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


class LintedSpec(_Closed):
    file: str
    ok: bool
    checked: list[str] = Field(description="what was checked and passed, one line each")
    issues: list[Issue]
    pipeline: list[PipelineCheck] = Field(default_factory=list, description="`lint --pp`: one per engine checked")


class LintOutput(_Output):
    ok: bool = Field(description="every spec is valid (warnings allowed); exit 2 otherwise")
    specs: list[LintedSpec]


class IdList(_Closed):
    convention: str
    origin: str = Field(description="where the rule was read: a probe of the engine source, or the built-in table")
    ids: list[int] | None = Field(description="null: not expressible (see error)")
    error: str | None
    captures: list[Point] = Field(description="what the ids capture, replayed through the engine's setter")
    kind: Literal["not_expressible", "refused"] | None = Field(
        default=None, description="null: ids given; not_expressible: the convention cannot name the points; "
                                  "refused: the target cannot serve them or cannot be read here")


class ExplainRow(_Closed):
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


class RenderedCapture(_Closed):
    fc_slot: int
    name: str
    point: Point
    captured: Point | None = Field(description="what the rendered ids capture, replayed")
    site: str | None = Field(default=None, description="file:line of the capture site the engine uses for this slot")
    verified: bool | None = Field(default=None, description="false when that site's value was not read")


class Launch(_Closed):
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


class DraftFinding(_Closed):
    severity: Literal["error", "warning", "info"]
    kind: str
    detail: str


class DraftNorm(_Closed):
    flag: Literal["norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"]
    state: Literal["used", "read_unused", "not_read", "unverified"] = Field(
        description="what the engine's draft model file does with the flag: used (a use site found), read_unused (read, "
                    "its value used nowhere: treated as not read), not_read, unverified (the value escapes to code not read)")
    read: str | None = Field(description="file:line of the read the state rests on")
    used_at: str | None = Field(description="used: file:line where the value changes the computation")
    builds: bool = Field(description="the value the engine builds the draft with")
    needs: bool = Field(description="the value the draft was trained with")
    detail: str


class DraftRunner(_Closed):
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


class ReviewCapture(_Closed):
    name: str
    was: Point | None
    now: Point | None


class ReviewIds(_Closed):
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


class CoverageCounts(_Closed):
    total: int
    classified: int
    no_capture: int
    delegates: int = Field(default=0, description="classes handing the ids to a text model the checkpoint picks")
    unclassified: int


class ProbedBypass(_Closed):
    line: int
    description: str
    layers: str
    path: str | None


class ProbedClass(_Closed):
    engine: str
    path: str
    class_name: str
    line: int
    status: Literal["classified", "unclassified"]
    reason: str | None
    setter: str | None
    setter_owner: str | None
    id_rule: str | None
    default: list[str] | None
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
    # being added next to this (issue 14): the capture sites read and whether the answer is verified
    sites: list[dict[str, Any]] | None = None
    verified: bool | None = None
    unverified_reason: str | None = None
    evidence: list[dict[str, Any]] | None = None


class ConventionsOutput(_Output):
    coverage: dict[str, CoverageCounts]
    engine: str
    version: str
    root: str
    files_scanned: int
    classified: int
    unclassified: int
    architectures: dict[str, str] = Field(description="registered architecture -> probed class")
    registered: dict[str, str] = Field(default_factory=dict,
                                       description="registered architecture without a capture interface -> path:line class")
    classes: list[ProbedClass]
    # being added next to this (issue 14): the platform answered for, per-platform dispatch, the runner read
    platform: str | None = None
    dispatch: dict[str, Any] | None = None
    runner: dict[str, Any] | None = None


# -- the wiring harness -----------------------------------------------------------------------------
class MatchedSlot(_Closed):
    name: str
    declared: Point | None
    matched: Point | None = Field(description="the point the slot holds; null: no point fits")
    rel_err: float | None = Field(description="relative error of the best candidate; null: not finite (NaN/Inf)")
    margin: float | None = Field(description="runner-up error / best error; null when exact")
    exact: bool = Field(description="the slot equals its best candidate bit for bit")
    verdict: Literal["ok", "mismatch", "no_match", "unlabelled", "undecided"] = Field(
        description="undecided: the slot fits several points about equally, its declared point among them")


class Diagnosis(_Closed):
    kind: str
    detail: str


class Suggested(_Closed):
    captures: dict[str, Point]
    engine_ids: dict[str, list[int] | str] = Field(description="engine -> ids for the corrected captures, or why none")


class MatchResult(_Closed):
    """A match or verify result (the demo nests two, without a format of their own)."""

    ok: bool = Field(description="nothing wrong and nothing undecided: every declared slot is its declared point, "
                                 "the others matched one point (exit 0; 3 on a mismatch, 4 when undecided)")
    verdict: Literal["ok", "mismatch", "undecided", "identified"] = Field(
        description="mismatch: a slot is not its declared point or matches none; undecided: else, a slot the "
                    "reference cannot tell apart (exit 4); identified: every slot matched one point, none declared")
    headline: str = Field(description="the report's first line: the verdict and the slots it rests on")
    slots: list[MatchedSlot]
    diagnosis: list[Diagnosis] = Field(description="what went wrong, the explanation covering the most slots first")
    missing: list[str] = Field(default_factory=list, description="the spec's dump slots ('name: point') at points "
                                                                "no slot's record gives (a mismatch)")
    suggested: Suggested
    subject: str
    layout: str
    reference: str
    alignment: str
    notes: list[str]


class MatchOutput(_Output, MatchResult):
    pass


class VerifyOutput(_Output, MatchResult):
    pass


# -- capture code and dumps ---------------------------------------------------------------------------
class DumpCapture(_Closed):
    name: str
    point: Point | None = Field(description="null: the file does not record it (a TensorRT-LLM or Model Optimizer "
                                            "dump without --slots)")
    shape: list[int] | None = Field(description="[tokens, hidden]; of the first record in a file of several")
    dtype: str | None = None


class DumpProducer(_Closed):
    detected: list[str] = Field(description="the producers whose writer gives a file these keys "
                                            "(trtllm, modelopt-hf, modelopt-vllm, modelopt-trtllm)")
    why: str = Field(description="what in the file decides it, with the writer's file:line")
    given: str | None = Field(description="the --slots PRODUCER:IDS the slots are labelled by; null: none")


class DumpRecord(_Closed):
    index: int
    id: str | None = Field(description="the record's id in the file (TensorRT-LLM 'id N', Model Optimizer "
                                       "'conversation C'); null when it has none")
    tokens: int = Field(description="this record's tokens")
    input_ids: bool
    loss_mask: int | None = Field(description="tokens in the loss (Model Optimizer's loss_mask); null: no mask")


class DumpSpec(_Closed):
    name: str | None
    sha256: str | None


class DumpInfoOutput(_Output):
    file: str
    dump_format: int | None = Field(description="the dump file's own format number")
    spec: DumpSpec
    engine: str | None
    engine_version: str | None
    model: str | None
    num_layers: int | None
    hidden_size: int | None = Field(description="the captures' hidden size (a file of several records: the first's)")
    tokens: int | None = Field(description="the captures' tokens: one sequence's, the first record's in a file of "
                                           "several (records[].tokens gives each record's)")
    dtype: str | None = Field(description="the captures' dtypes, comma-separated (a file of several records: the first's)")
    captures: list[DumpCapture] = Field(description="the slots of the dump's one sequence, or of its first record")
    other_metadata: dict[str, str] = Field(description="metadata keys this surgeon does not interpret")
    layout: Literal["surgeon", "trtllm", "modelopt", "specforge", "vllm-connector"] = Field(
        default="surgeon",
        description="surgeon dump, TensorRT-LLM SaveHiddenStates list, Model Optimizer collect_hidden_states dict, "
                    "SpecForge .ckpt, or vLLM hidden-state connector / speculators hidden_states stack")
    labelled: bool = Field(default=True, description="every capture's point is known")
    producer: DumpProducer | None = Field(default=None,
                                          description="a TensorRT-LLM or Model Optimizer dump's; null for a surgeon dump")
    records: list[DumpRecord] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


class ExportOutput(_Output):
    layout: Literal["specforge", "speculators"]
    written: list[str]
    manifest: str | None = Field(default=None,
                                 description="surgeon-export.json: per written file its source and each slot's point")


class HookFinding(_Closed):
    file: str
    line: int
    col: int
    rule: str
    message: str


class CheckHooksOutput(_Output):
    ok: bool = Field(description="no finding (exit 3 otherwise)")
    findings: list[HookFinding]


# -- patches --------------------------------------------------------------------------------------------
class SpecRef(_Closed):
    name: str
    sha256: str


class ApplyOutput(_Output):
    patch: str
    engine: str
    engine_version: str
    engine_root: str
    model_file: str
    loop_class: str | None
    hooks_file: str
    hooks_module: str
    mode: Literal["dump", "aux"]
    max_tokens: int
    recipe: str
    anchors: list[str]
    spec: SpecRef
    dry_run: bool
    changed: bool | None = Field(description="null on a dry run")
    files_written: list[str]
    replaced: list[str]
    recovered: str | None
    diff: str | None = Field(None, description="present with --diff")


class EngineRevert(_Closed):
    engine: str
    engine_root: str
    reverted: list[str]
    restored: list[str]
    warnings: list[str]
    recovered: str | None


class RevertOutput(_Output):
    reverted: list[EngineRevert]


class PatchedFile(_Closed):
    relpath: str
    state: str
    created: bool
    sha256_before: str
    sha256_after: str


class AppliedPatch(_Closed):
    engine: str
    engine_root: str
    name: str
    state: str = Field(description="applied, drifted or missing")
    spec: SpecRef
    engine_version: str
    created: str
    files: list[PatchedFile]


class StatusOutput(_Output):
    ok: bool = Field(description="every patched file is as applied (exit 3 otherwise)")
    patches: list[AppliedPatch]
    # being added next to this (issue 14): patched files no manifest records, interrupted transactions
    unrecorded: list[dict[str, Any]] | None = None
    recovered: list[str] | None = None
    pending: list[str] | None = None


class DoctorFinding(_Closed):
    path: str
    problem: str
    action: str | None
    fixed: bool
    repairable: bool


class DoctorEngine(_Closed):
    engine: str
    engine_root: str
    repair: bool
    healthy: bool
    findings: list[DoctorFinding]


class DoctorOutput(_Output):
    ok: bool = Field(description="nothing is left unfixed (exit 3 otherwise)")
    healthy: bool
    engines: list[DoctorEngine]


class DiffFile(_Closed):
    relpath: str
    created: bool
    state: str


class PatchDiff(_Closed):
    engine: str
    name: str
    state: str
    files: list[DiffFile]
    diff: str


class DiffOutput(_Output):
    patches: list[PatchDiff]


class ClassCoverage(_Closed):
    path: str
    class_name: str
    method: str
    line: int
    decoder: bool
    layers: bool
    embed: bool
    final_norm: bool
    reason: str | None
    embed_reason: str | None
    final_norm_reason: str | None
    recipe: str | None
    native: list[str]
    with_guard: bool
    patchable: bool
    patchable_with_guard: bool


class CoverageFigures(_Closed):
    patchable: int
    total: int
    fraction: float
    patchable_with_guard: int
    fraction_with_guard: float


class UnparsedFile(_Closed):
    path: str
    reason: str


class EngineCoverage(_Closed):
    engine: str
    version: str
    root: str
    files: int
    files_parsed: int
    seconds: float
    probe_error: str | None
    unparsed: list[UnparsedFile]
    decoder: CoverageFigures
    all: CoverageFigures
    native: int
    final_norm: int
    classes: list[ClassCoverage]
    # being added next to this (issue 14): the platform, per-directory counts, non-decoder classes apart
    platform: str | None = None
    trees: list[dict[str, Any]] | None = None
    non_decoder: dict[str, Any] | None = None
    decoder_failures: list[str] | None = None


class CoverageOutput(_Output):
    seconds: float
    engines: list[EngineCoverage]


# -- demo -------------------------------------------------------------------------------------------------
class DemoOutput(_Output):
    ok: bool = Field(description="the spec's wiring verified, the mis-wiring was caught, the revert is byte-identical, "
                                 "and the draft step named its trained wiring")
    workdir: str
    model: str
    spec: str
    wrong_spec: str
    reference: str
    dump: str
    heatmap: str
    heatmap_right: str
    engine_root: str
    model_file: str
    reverted_byte_identical: bool
    right: MatchResult | None
    wrong: MatchResult | None
    draft: dict[str, Any] | None = Field(description="the draft step (surgeon.draft.demo): ok, trained_on, drop, and "
                                                     "the infer-wiring and accept outputs")
    timings_s: dict[str, float]


class InferSlot(_Closed):
    slot: int
    point: Point
    score: float = Field(description="alignment of the fc slot's amplification W_j^T W_j (isotropic part removed) "
                                     "with this point's state covariance; relative to its slot")
    runner_up: Point | None
    runner_up_score: float | None
    margin: float | None = Field(description="(score - runner_up_score) / score; null when nothing aligns")
    decides: bool = Field(description="the margin is wide enough and the decided behaviour signal does not contradict it")
    contradicted: bool = Field(description="the decided behaviour signal names another point for this slot")


class InferWeightSpace(_Closed):
    wiring: list[Point]
    margin: float | None = Field(description="the smallest slot margin")
    decides: bool
    slots: list[InferSlot]


class InferBehaviour(_Closed):
    wiring: list[Point]
    steps: int = Field(description="chained draft steps the divergence sums over")
    divergence: float | None = Field(description="KL from the target's next-token distribution to the draft's, nats per "
                                                 "position summed over the chained steps, mean over prompts (searched)")
    agreement: float | None = Field(description="step-1 top-1 agreement with the target's greedy next token (reported)")
    runner_up: list[Point] | None
    runner_up_divergence: float | None
    runner_up_agreement: float | None
    margin: float | None = Field(description="the runner-up's divergence minus the chosen wiring's (nats)")
    z: float | None = Field(description="margin over the standard error of the per-prompt differences (null: one prompt)")
    decides: bool | None
    evaluations: int


class InferCandidate(_Closed):
    label: str
    wiring: list[Point]
    weight_score: float = Field(description="mean over slots of the alignment relative to the slot's best (1: every slot's best)")
    agreement: float | None
    divergence: float | None


class InferIds(_Closed):
    ids: list[int] | None
    error: str | None = Field(description="why there are no ids, the reason alone (null: ids given)")
    origin: str | None
    kind: Literal["not_expressible", "refused"] | None = Field(
        default=None, description="null: ids given; not_expressible: the target's convention cannot name the "
                                  "wiring; refused: the target cannot serve it or cannot be read here")


class InferStatedEngine(_Closed):
    engine: str
    agrees: bool | None = Field(description="null: not checked (see problems)")
    reads: list[int] | None
    captures: list[Point | None]
    problems: list[str]


class InferStated(_Closed):
    ids: dict[str, list[int]] = Field(description="config key -> ids as written")
    agree: bool | None
    engines: list[InferStatedEngine]


class InferWiringOutput(_Output):
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


class AcceptWiring(_Closed):
    name: str
    why: str
    points: list[str | None] = Field(description="the point fed to each fc slot; null: never captured")
    note: str | None
    not_servable: str | None = Field(description="why this wiring cannot run at all (null: it runs)")
    per_position: list[float] | None = Field(description="P(accepted > j) for draft position j = 0..K-1")
    expected_accepted: float | None = Field(description="expected accepted draft tokens per chain")
    accept_length: float | None = Field(description="1 + expected_accepted: the target's bonus token counted")
    chains: int
    divergence: float | None = Field(description="KL from the target's next-token distribution to the draft's, nats "
                                                 "per chain summed over its K steps (null: not measured)")


class AcceptOutput(_Output):
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
    min: float | None
    draft_info: dict[str, Any]
    sampling: str
    wirings: list[AcceptWiring] = Field(description="the spec's wiring first, then the miswirings")
    notes: list[str]
    timings_s: dict[str, float]


# -- audit of a training set -------------------------------------------------------------------------
class AuditFinding(_Closed):
    kind: str = Field(description="structure, unreadable, nonfinite, zero, constant, repeated, stale, identity, exact; "
                                  "error: the file's audit hit an error no check foresaw (exit 1)")
    slot: str | None
    detail: str


class AuditOutlier(_Closed):
    path: str
    findings: list[AuditFinding]


class AuditSlot(_Closed):
    name: str
    declared: Point | None
    files: int
    norm_mean: float | None = Field(description="mean over files of the slot's mean per-token L2 norm")
    norm_min: float | None
    norm_max: float | None
    log_norm_median_mean: float | None = Field(description="the identity statistic (median log per-token norm), "
                                                           "its mean over files")
    log_norm_median_std: float | None
    identity: dict[str, int] = Field(description="nearest point of the profile (or the verdict) -> files")
    verdicts: dict[str, int] = Field(description="the statistics' identity verdicts: ok, mismatch, no_match, "
                                                 "unresolved, not_run -> files (every key, 0 included)")
    exact: dict[str, int] = Field(description="on the files identified exactly: matched point (or verdict) -> files")
    exact_verdicts: dict[str, int] = Field(description="exact identification's verdicts: ok, mismatch, no_match, "
                                                       "undecided, unlabelled -> files (every key, 0 included)")
    undecided: int = Field(description="files whose identity neither the statistics (unresolved, or not_run without "
                                       "a finding of the slot's own) nor exact identification decided")


class AuditPointProfile(_Closed):
    point: Point
    centre: float
    spread: float
    tol: float


class AuditProfile(_Closed):
    source: str
    prompts: int
    tokens: int
    ladder: list[int] = Field(description="the rungs of sample lengths judged each against its own profile: rung n "
                                          "holds samples of n to 2n-1 rows (the last, longer ones too); [] : one "
                                          "profile for every length")
    points: list[AuditPointProfile]


class AuditExact(_Closed):
    model: str | None = Field(description="the HF model folder run on each file's own tokens; null: no --reference hf:")
    files: int = Field(description="files identified exactly (this run's and the resume state's)")
    budget: int | None = Field(description="--exact N; null: auto (see rule)")
    rule: str = Field(description="the budget's rule in words")
    params: int | None = Field(description="the target's parameter count (its safetensors headers); null: not read")
    undecided_files: int = Field(description="files the statistics left undecided: the escalation's candidates")
    escalated: int = Field(description="of those, the files selected for exact identification")
    spot_checked: int = Field(description="other files selected, evenly spaced, as a spot check")
    found: int = Field(description="files identified exactly with a slot not its declared point")
    seconds: float = Field(description="wall time of this run's exact identification")


class AuditOutput(_Output):
    ok: bool = Field(description="no file has a finding and every slot's identity is decided for most of its files "
                                 "(exit 3 on a finding, else 4 when undecided; 1 where a file's audit hit an error)")
    verdict: Literal["ok", "flagged", "undecided", "error"] = Field(
        description="flagged: a file has a finding (exit 3); undecided: none has, but the identity of most files of a "
                    "slot is undecided (exit 4); error: a file's audit hit an error no check foresaw (exit 1)")
    headline: str = Field(description="the report's first line: the verdict and, where undecided, what the run cannot see")
    undecided: list[str] = Field(description="the slots whose identity is undecided for most of their files")
    cannot_see: list[str] = Field(description="where a slot is undecided: the faults only the identity pass finds, "
                                              "which this run cannot see; else []")
    root: str
    spec: str
    files: int
    resumed: int = Field(description="files whose results came from the resume state")
    flagged: int
    findings: dict[str, int] = Field(description="finding kind -> files with it")
    layouts: dict[str, int]
    seconds: float
    bytes: int
    files_per_s: float | None
    mb_per_s: float | None
    workers: int
    backend: str
    structure_only: bool
    slots: list[AuditSlot]
    exact: AuditExact
    profile: AuditProfile | None
    outliers: list[AuditOutlier] = Field(description="flagged files in path order (the first 1000)")
    outliers_listed: int
    notes: list[str]
    report: str | None = Field(description="the HTML report written, if any")


OUTPUTS: dict[str, type[_Output]] = {
    "lint": LintOutput, "explain": ExplainOutput, "render": RenderOutput, "check-draft": CheckDraftOutput,
    "review": ReviewOutput, "conventions": ConventionsOutput, "match": MatchOutput, "verify": VerifyOutput,
    "dump-info": DumpInfoOutput, "export": ExportOutput, "check-hooks": CheckHooksOutput,
    "apply": ApplyOutput, "revert": RevertOutput, "status": StatusOutput, "diff": DiffOutput,
    "coverage": CoverageOutput, "demo": DemoOutput, "doctor": DoctorOutput,
    "infer-wiring": InferWiringOutput, "accept": AcceptOutput, "audit": AuditOutput,
}


def output_schema(name: str) -> dict:
    """The JSON Schema (draft 2020-12) of ``surgeon NAME --json``, its format number fixed."""
    from surgeon.core.errors import BadInput

    model = OUTPUTS.get(name)
    if model is None:
        raise BadInput(f"no --json output named {name!r}; one of: spec, {', '.join(OUTPUTS)}")
    schema = model.model_json_schema()
    schema["properties"]["format"]["const"] = FORMATS[name]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": f"surgeon:output/{name}/{FORMATS[name]}",
            **schema, "title": f"surgeon {name} --json, format {FORMATS[name]}"}
