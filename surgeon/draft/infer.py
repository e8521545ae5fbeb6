"""`surgeon infer-wiring`: the wiring a draft's fc was trained on, found from its weights (and, where a
draft runtime is given, its behaviour), in every engine's ids.

The fc is linear, so a slot's contribution ``S_p W_j^T`` is computed once per (slot, point)
(:func:`surgeon.draft.weightspace.contributions`) and a candidate wiring's fc output is a sum of
``n_slots`` of them: scoring a candidate costs an addition, not an fc forward. The search:

1. structured candidates (:func:`structured_candidates`): each engine's default ids, the ids the
   draft config states decoded under every convention that could have written them, their
   off-by-ones, the labels shifted by one slot, the order reversed;
2. a per-slot search over every point: the weight-space score is a sum over slots, so its best
   wiring is each slot's best point (distinct points; :func:`best_distinct`); with a behaviour
   signal, coordinate ascent from the best candidate, one slot at a time over every point.

A behaviour signal is anything with ``evaluate(fused) -> Evaluation`` (:class:`Behaviour`), given
the fc's output for every prompt token: the draft's divergence from the target, per prompt, and its
step-1 top-1 agreement. The search minimises the divergence: the KL from the target's next-token
distribution to the draft's, per position, summed over ``CHAIN_STEPS`` chained draft steps (the
TTT loss SpecForge trains, ``surgeon.draft.synthetic.chain_loss``, without its step weights).
Argmax agreement saturates: measured on the trained seed draft (``surgeon.draft.synthetic``) every
wiring of the induction target agreed within one point, so the agreement is reported, not searched.
The verdict is a paired test over prompts: the best wiring must lead the runner-up by
``BEHAVIOUR_Z`` standard errors of the per-prompt difference and by ``BEHAVIOUR_RELATIVE`` of its
own divergence, else the report says the evidence does not decide. It costs one draft forward per
candidate, so it is only run on the structured candidates and the per-slot search, never on the
product of all points.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import yaml
from safetensors import safe_open

from surgeon.core.conventions import EAGLE, HF, Convention
from surgeon.core.errors import UNDECIDED, BadInput, SurgeonError
from surgeon.core.points import Point, all_points
from surgeon.core.shapes import Reads, reads
from surgeon.core.spec import load_spec
from surgeon.draft.behaviour import LOGPROB_BYTES, DraftBehaviour, Evaluation, target_logprobs
from surgeon.draft.model import Eagle3Draft, load_draft
from surgeon.draft.weightspace import (
    SlotScore,
    alignment_table,
    contributions,
    dead_slots,
    slot_blocks,
    slot_scores,
)
from surgeon.engines.view import open_engine
from surgeon.verify.reference import capture_reference, read_model_config, require_finite, resolve_model
from surgeon.wiring.draft import CHECK_TARGETS, check_draft, fc_weight_shape, read_config, read_ids
from surgeon.wiring.render import RENDER_TARGETS, IdList, target_ids

Wiring = tuple[int, ...]  # one index into the candidate points per fc slot


class Behaviour(Protocol):
    """The draft's divergence from the target and its agreement, given the fc output ``fused``
    ``[N, out]`` for every prompt token (prompts concatenated in order)."""

    def evaluate(self, fused: torch.Tensor) -> Evaluation: ...


@dataclass(frozen=True)
class Candidate:
    """A named wiring (its origin, e.g. "vllm default ids") and its scores."""

    label: str
    wiring: Wiring
    weight_score: float  # mean over slots of alignment / the slot's best alignment (1: each slot's best)
    agreement: float | None = None
    divergence: float | None = None  # mean over prompts, nats per chained position


@dataclass
class Search:
    """Everything the search found: per-slot weight-space verdicts, the candidates it scored, the
    chosen wiring and its margins over the runner-up under each signal."""

    points: list[Point]
    table: torch.Tensor  # [n_slots, P] alignments
    slots: list[SlotScore]
    weight_wiring: Wiring
    candidates: list[Candidate]
    wiring: Wiring
    behaviour_margin: float | None = None  # the runner-up's divergence minus the best's (nats)
    behaviour_z: float | None = None  # that margin over the standard error of its per-prompt differences
    behaviour_runner_up: Wiring | None = None
    behaviour_evaluations: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def weight_decides(self) -> bool:
        return all(s.decides for s in self.slots)

    @property
    def weight_margin(self) -> float | None:
        """The smallest slot margin: the runner-up wiring differs from the best in that slot."""
        margins = [s.margin for s in self.slots if s.margin is not None]
        return min(margins) if margins else None


def point_index(points: Sequence[Point]) -> dict[Point, int]:
    return {p: i for i, p in enumerate(points)}


def wiring_score(table: torch.Tensor, wiring: Wiring) -> float:
    """Weight-space score of a wiring: the mean over slots of its alignment relative to the slot's
    best (each slot weighs alike; 1.0 is every slot on its best point)."""
    best = table.max(dim=1).values
    return sum(float(table[j, p]) / max(float(best[j]), 1e-300) for j, p in enumerate(wiring)) / len(wiring)


def best_distinct(table: torch.Tensor, top: int = 6) -> Wiring:
    """The wiring maximising :func:`wiring_score` with every slot on a different point (an engine
    captures each point once): each slot's best point when they differ, else the best combination
    of each slot's ``top`` points."""
    n, P = table.shape
    firsts = tuple(int(table[j].argmax()) for j in range(n))
    if len(set(firsts)) == n:
        return firsts
    tops = [torch.argsort(table[j], descending=True)[:min(top, P)].tolist() for j in range(n)]
    combos = (c for c in itertools.product(*tops) if len(set(c)) == n)
    return max(combos, key=lambda c: wiring_score(table, c), default=firsts)


def _shifted(base: Wiring, P: int) -> list[tuple[str, Wiring]]:
    """The labels shifted by one slot: the fc's true points are the stated ones moved one slot
    along, with a new point at the free end (the Kimi-K2.5 case: stated [embed, l2, l30], trained
    [l2, l30, l58])."""
    out = []
    n = len(base)
    if n > 1:
        out += [("stated labels shifted left by a slot", base[1:] + (x,)) for x in range(base[-1] + 1, P)]
        out += [("stated labels shifted right by a slot", (x,) + base[:-1]) for x in range(0, base[0])]
    return out


def structured_candidates(named: Sequence[tuple[str, Sequence[Point]]], points: Sequence[Point],
                          n_slots: int) -> list[tuple[str, Wiring]]:
    """Candidates built from named wirings (defaults, decoded stated ids): each as named, each slot
    off by one either way, shifted by a slot, reversed. Wirings of the wrong length or with points
    the target lacks are dropped; duplicates keep their first label."""
    index = point_index(points)
    P = len(points)
    seen: dict[Wiring, str] = {}

    def add(label: str, w: Sequence[int]) -> None:
        w = tuple(w)
        if len(w) == n_slots and all(0 <= i < P for i in w) and len(set(w)) == n_slots and w not in seen:
            seen[w] = label

    for label, wiring in named:
        if len(wiring) != n_slots or any(p not in index for p in wiring):
            continue
        base = tuple(index[p] for p in wiring)
        add(label, base)
        for j in range(n_slots):
            for d in (-1, 1):
                add(f"{label}, slot {j} off by {d:+d}", base[:j] + (base[j] + d,) + base[j + 1:])
        for shifted_label, w in _shifted(base, P):
            add(f"{label}: {shifted_label}", w)
        add(f"{label}, order reversed", base[::-1])
    return [(label, w) for w, label in seen.items()]


class Contributions:
    """``S_p W_j^T`` per (slot, point): all of them precomputed (:func:`contributions`), or each
    computed when first asked for and kept (what a large target needs: the behaviour search asks
    for a few points per slot, the weight-space table does not need them at all when sketched)."""

    def __init__(self, weight: torch.Tensor, states: torch.Tensor, full: torch.Tensor | None = None) -> None:
        self.blocks = slot_blocks(weight, states.shape[-1])
        self.states, self.full = states, full
        self.cache: dict[tuple[int, int], torch.Tensor] = {}

    def __getitem__(self, key: tuple[int, int]) -> torch.Tensor:
        j, p = key
        if self.full is not None:
            return self.full[j, p]
        if key not in self.cache:
            self.cache[key] = self.states[p].to(self.blocks[j].dtype) @ self.blocks[j].T
        return self.cache[key]


def fused_output(contrib: torch.Tensor | Contributions, wiring: Wiring, bias: torch.Tensor | None) -> torch.Tensor:
    """The fc output ``[N, out]`` for a wiring: the sum of its slots' contributions."""
    out = contrib[0, wiring[0]].clone()
    for j in range(1, len(wiring)):
        out += contrib[j, wiring[j]]
    if bias is not None:
        out += bias
    return out


def search(weight: torch.Tensor, states: torch.Tensor, points: Sequence[Point], contrib: torch.Tensor | None,
           named: Sequence[tuple[str, Sequence[Point]]], *, bias: torch.Tensor | None = None,
           behaviour: Behaviour | None = None, fuse: Callable[[Wiring], torch.Tensor] | None = None,
           sketch: int | None = None) -> Search:
    """Weight-space table and best wiring, the structured candidates scored, and (with
    ``behaviour``) the agreement search; see the module docstring. ``fuse`` replaces the sum of
    contributions where the draft's fc input is not linear in the slots (a norm before the fc).
    Without ``contrib`` the contributions are computed as the behaviour search needs them, and
    with ``sketch`` the weight-space table is estimated through a sketch of that width
    (:func:`surgeon.draft.weightspace.alignment_table`)."""
    points = list(points)
    table = alignment_table(weight, states, contrib, sketch=sketch)
    lazy = Contributions(weight, states, contrib)
    n = table.shape[0]
    best = best_distinct(table)
    structured = structured_candidates(named, points, n)
    scored = [Candidate(label, w, wiring_score(table, w)) for label, w in structured]
    if best not in {c.wiring for c in scored}:
        scored.append(Candidate("per-slot search (weight space)", best, wiring_score(table, best)))
    result = Search(points, table, slot_scores(table, points), best, scored, best)
    if behaviour is not None:
        _behaviour_search(result, fuse or (lambda w: fused_output(lazy, w, bias)), behaviour)
    result.candidates.sort(key=lambda c: (c.divergence if c.divergence is not None else float("inf"), -c.weight_score))
    return result


def _behaviour_search(result: Search, fuse: Callable[[Wiring], torch.Tensor], behaviour: Behaviour) -> None:
    """Divergence of every candidate, then coordinate descent from the best one over every point,
    slot by slot, until no single-slot change lowers it; records the margin over the runner-up
    and its paired z (module docstring)."""
    cache: dict[Wiring, Evaluation] = {}

    def ev(w: Wiring) -> Evaluation:
        if w not in cache:
            cache[w] = behaviour.evaluate(fuse(w))
        return cache[w]

    result.candidates = [Candidate(c.label, c.wiring, c.weight_score, ev(c.wiring).agreement, ev(c.wiring).mean)
                         for c in result.candidates]
    current = min(result.candidates, key=lambda c: (ev(c.wiring).mean, -c.weight_score)).wiring
    n, P = result.table.shape
    for _ in range(3):  # rounds of coordinate descent; each visits every (slot, point)
        improved = False
        for j in range(n):
            for p in range(P):
                w = current[:j] + (p,) + current[j + 1:]
                if len(set(w)) == n and ev(w).mean < ev(current).mean:
                    current, improved = w, True
        if not improved:
            break
    known = {c.wiring for c in result.candidates}
    for w, e in cache.items():
        if w not in known:
            result.candidates.append(Candidate("per-slot search (behaviour)", w, wiring_score(result.table, w),
                                               e.agreement, e.mean))
    others = sorted((e.mean, w) for w, e in cache.items() if w != current)
    result.wiring = current
    result.behaviour_evaluations = len(cache)
    if others:
        runner = others[0][1]
        result.behaviour_runner_up = runner
        result.behaviour_margin, result.behaviour_z = paired_margin(cache[current].divergence, cache[runner].divergence)


def paired_margin(best: torch.Tensor, runner_up: torch.Tensor) -> tuple[float, float | None]:
    """The runner-up's mean divergence minus the best's, and that over the standard error of the
    per-prompt differences (None with one prompt; inf when every prompt differs alike)."""
    diff = (runner_up - best).double()
    margin = float(diff.mean())
    if diff.numel() < 2:
        return margin, None
    se = float(diff.std()) / diff.numel() ** 0.5
    return margin, (margin / se if se > 0 else (float("inf") if margin > 0 else 0.0))


#: the best wiring decides when it leads the runner-up by this many standard errors of the paired
#: per-prompt differences ...
BEHAVIOUR_Z = 3.0
#: ... and by this fraction of its own divergence
BEHAVIOUR_RELATIVE = 0.02
#: chained draft steps the divergence sums over (SpecForge trains 7; the seed drafts here 3)
CHAIN_STEPS = 3


def describe(points: Sequence[Point], wiring: Wiring) -> list[str]:
    return [str(points[i]) for i in wiring]


def target_points(num_layers: int) -> list[Point]:
    """Every point an fc slot could read: embed, each layer_out, final_norm."""
    return all_points(num_layers)

# ---------------------------------------------------------------------------------------------
# From files: the draft's fc and stated ids, the target's states, the named wirings, the report
# ---------------------------------------------------------------------------------------------
ENGINES = ("sglang", "vllm")
#: above this many multiply-adds the slot contributions are not all formed: the weight-space table is
#: sketched (:func:`surgeon.draft.weightspace.alignment_table`) and the behaviour search forms only
#: the contributions it asks for (at Kimi shape, 63 points x 128 tokens: 2.5 T, so sketched)
FULL_CONTRIBUTIONS_MACS = 5e10
SKETCH = 512
WEIGHT_ONLY = ("weight-space evidence alone never decides: on fc layers fit to known points it names them "
               "(tests/draft/test_weightspace.py), but on an EAGLE-3 draft trained end to end with AdamW "
               "(surgeon.draft.synthetic's seed draft) it named wrong points by margins up to 54%: such an fc "
               "hardly leaves its initialisation (surgeon/draft/weightspace.py); give a draft that loads as an "
               "EAGLE-3 model for the behaviour signal")


@dataclass(frozen=True)
class DraftFc:
    """What infer-wiring reads from a draft folder: its config, the ids it states, its fc."""

    path: str
    config: dict
    stated: dict[str, list[int] | None]  # config key -> ids as written (None: absent)
    weight: torch.Tensor  # [out, n_slots * H]
    bias: torch.Tensor | None
    tensor: str  # "file:name" of the fc weight


def read_draft_fc(draft: str) -> DraftFc:
    """The draft folder's config.json ids (as check-draft reads them) and fc weight (and bias)
    from its safetensors; BadInput when either is missing or unreadable."""

    path = Path(draft)
    if not path.is_dir():
        raise BadInput(f"{draft}: not a draft folder (expected config.json and *.safetensors)")
    cfg, data = read_config(path)
    stated = read_ids(cfg, data)
    found = fc_weight_shape(path)
    if found is None:
        raise BadInput(f"{draft}: no fc.weight in its *.safetensors: not an EAGLE-3 draft")
    name = found["tensor"]
    try:
        with safe_open(str(path / found["file"]), framework="pt") as f:
            weight = f.get_tensor(name).float()
            bias_name = name[: -len("weight")] + "bias"
            bias = f.get_tensor(bias_name).float() if bias_name in f.keys() else None
    except (OSError, RuntimeError, ValueError) as e:
        raise BadInput(f"{path / found['file']}: cannot read {name}: {str(e).splitlines()[0][:160]}") from None
    if weight.dim() != 2:
        raise BadInput(f"{path / found['file']}: {name} has shape {list(weight.shape)}, not a matrix")
    require_finite([(name, weight)] + ([] if bias is None else [(bias_name, bias)]), str(path / found["file"]))
    return DraftFc(str(path), data, stated, weight, bias, f"{found['file']}:{name}")


@dataclass(frozen=True)
class TargetStates:
    """The target's states at every candidate point over a few prompts: ``states[p]`` ``[N, H]``
    with the prompts' tokens concatenated in order (``lengths`` says where each ends)."""

    source: str
    folder: str
    architecture: str
    num_layers: int
    hidden_size: int
    points: list[Point]
    states: torch.Tensor  # [P, N, H]
    input_ids: list[torch.Tensor]

    @property
    def lengths(self) -> list[int]:
        return [int(t.numel()) for t in self.input_ids]


def default_prompts(vocab_size: int, *, count: int = 16, length: int = 36, seed: int = 0) -> list[torch.Tensor]:
    """``count`` prompts of ``length`` token ids (seeded): a run of ``length // 3`` distinct random
    tokens repeated. Repeats are where a target's deep states matter (copying the token that
    followed the previous occurrence takes an induction circuit over several layers); on uniform
    random tokens a draft can ignore the states and every wiring scores alike."""
    g = torch.Generator().manual_seed(seed)
    run = max(length // 3, 1)
    out = []
    for _ in range(count):
        base = (torch.randperm(vocab_size, generator=g)[:run] if vocab_size >= run
                else torch.randint(0, vocab_size, (run,), generator=g))
        out.append(base.repeat(-(-length // run))[:length])
    return out


def target_config(model_dir) -> tuple[str, int, int, int]:
    """(architecture, num_hidden_layers, hidden_size, vocab_size) from a model folder's config.json."""

    cfg = Path(model_dir) / "config.json"
    data = read_model_config(Path(model_dir))
    archs = data.get("architectures")
    values = [data.get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")]
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)) or not all(
            type(v) is int and v > 0 for v in values):
        raise BadInput(f"{cfg}: needs architectures, num_hidden_layers, hidden_size and vocab_size")
    L, H, vocab = (int(v or 0) for v in values)  # checked above: positive ints
    return archs[0], L, H, vocab


def collect_states(target: str, prompts: Sequence[torch.Tensor] | None = None) -> TargetStates:
    """Run the target (a model folder, ``hf:DIR`` or ``hf:ORG/NAME`` in the local cache) once per
    prompt and stack its states at every candidate point."""

    model_dir, source = resolve_model(target[3:] if target.startswith("hf:") else target)
    arch, L, H, vocab = target_config(model_dir)
    prompts = list(prompts) if prompts is not None else default_prompts(vocab)
    points = target_points(L)
    per_prompt = []
    for ids in prompts:
        ref = capture_reference(model_dir, ids)
        per_prompt.append(torch.stack([ref.states[p] for p in points]))
    return TargetStates(source, str(model_dir), arch, L, H, points, torch.cat(per_prompt, dim=1),
                        [torch.as_tensor(p) for p in prompts])


def named_wirings(stated: dict[str, list[int] | None], architecture: str, num_layers: int,
                  notes: list[str]) -> list[tuple[str, list[Point]]]:
    """Each engine's default wiring and the stated ids decoded under every convention that could
    have written them (SpecForge/EAGLE, HF output_hidden_states, each engine's setter for the
    target's class, read from its source). A convention that cannot decode them is skipped, and
    an engine that cannot be read is named in ``notes``."""

    convs: list[tuple[str, Convention]] = [("SpecForge", EAGLE), ("HF hidden_states", HF)]
    for engine in ENGINES:
        try:
            convs.append((engine, open_engine(engine).convention(architecture)))
        except (SurgeonError, ValueError, OSError) as e:  # that engine's candidates are left out
            notes.append(f"{engine}: not read ({str(e).splitlines()[0][:160]})")
    named: list[tuple[str, list[Point]]] = []
    for name, conv in convs:
        if name == "HF hidden_states":
            continue  # HF has no default id list
        try:
            named.append((f"{name} default ids", [p for p in conv.decode(None, num_layers) if p is not None]))
        except ValueError:
            pass
    for key, ids in stated.items():
        if not ids:
            continue
        shift = [i + 1 for i in ids] if key.startswith("dflash") else list(ids)  # vLLM adds 1 to DFlash ids
        for name, conv in convs:
            try:
                decoded = conv.decode(shift if name == "vllm" else ids, num_layers)
            except ValueError:
                continue
            if all(p is not None for p in decoded):
                named.append((f"{key} = {ids} read as {name}", [p for p in decoded if p is not None]))
    return named


def spec_text(name: str, states: TargetStates, wiring: Sequence[Point], draft: str) -> str:
    """A spec v1 for the inferred wiring (fc_input in slot order), for review."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "draft"
    if not safe[0].isalnum():
        safe = "d" + safe
    names = [f"slot{j}" for j in range(len(wiring))]
    body = {
        "spec": 1,
        "name": f"{safe}-inferred",
        "description": f"inferred by surgeon infer-wiring from {draft} against {states.source}: review before use",
        "target": {"architecture": states.architecture, "num_layers": states.num_layers,
                   "hidden_size": states.hidden_size},
        "captures": {n: str(p) for n, p in zip(names, wiring)},
        "draft": {"kind": "eagle3", "fc_input": names, "fc_in_features": len(wiring) * states.hidden_size},
    }
    return yaml.safe_dump(body, sort_keys=False, width=200)


def engine_ids(spec) -> dict[str, IdList]:
    """Each render target's ids for the spec's fc_input, from its entry in the render targets' table
    (:func:`surgeon.wiring.render.target_ids`), or why none (``kind``: not_expressible or refused)."""
    return {target: target_ids(spec, target) for target in RENDER_TARGETS}


@dataclass(frozen=True)
class StatedCheck:
    """check-draft of the draft config's ids on one engine, against the inferred spec."""

    engine: str
    agrees: bool | None  # None: not checked (see problems)
    reads: list[int] | None  # the ids the engine reads (None: none, its default)
    captures: list[str | None]  # what they make it capture, in fc order
    problems: list[str]


def stated_check(spec, draft: str) -> list[StatedCheck]:
    """check-draft of the draft's config against the inferred spec, per engine: what it reads,
    what that makes it capture, and each slot where that differs."""
    rows: list[StatedCheck] = []
    for engine in CHECK_TARGETS:
        try:
            rep = check_draft(spec, draft, engine)
        except (SurgeonError, ValueError) as e:
            rows.append(StatedCheck(engine, None, None, [], [f"not checked: {e}"]))
            continue
        problems = [f.detail for f in rep.findings if f.severity == "error"]
        rows.append(StatedCheck(engine, rep.ok, rep.ids_used, rep.captured, problems))
    return rows


# -- what the report says, as infer-wiring prints it ------------------------------------------


@reads("score_of", "slot runner_up_score margin")
@dataclass(frozen=True)
class SlotVerdict:
    """One slot's weight-space verdict as reported: it does not decide where the decided behaviour
    signal names another point for the slot (``contradicted``)."""

    score_of: SlotScore
    contradicted: bool
    score = Reads("score_of.best_score")

    @property
    def point(self) -> str:
        return str(self.score_of.best)

    @property
    def runner_up(self) -> str | None:
        return None if self.score_of.runner_up is None else str(self.score_of.runner_up)

    @property
    def decides(self) -> bool:
        return self.score_of.decides and not self.contradicted


@dataclass(frozen=True)
class WeightSpaceVerdict:
    """The weight-space evidence: its best wiring, the smallest slot margin, each slot's verdict."""

    wiring: list[str]
    margin: float | None
    decides: bool
    slots: list[SlotVerdict]


@dataclass(frozen=True)
class BehaviourVerdict:
    """The behaviour signal: the chosen wiring's divergence and agreement, the runner-up's, and the
    paired margin between them (module docstring)."""

    wiring: list[str]
    steps: int
    divergence: float | None
    agreement: float | None
    runner_up: list[str] | None
    runner_up_divergence: float | None
    runner_up_agreement: float | None
    margin: float | None
    z: float | None
    decides: bool | None
    evaluations: int


@dataclass(frozen=True)
class CandidateRow:
    """A scored candidate, its wiring named by points."""

    label: str
    wiring: list[str]
    weight_score: float
    agreement: float | None
    divergence: float | None


@dataclass(frozen=True)
class StatedIds:
    """The ids the draft config states (config key -> ids), and each engine's reading of them."""

    ids: dict[str, list[int]]
    agree: bool | None
    engines: list[StatedCheck]


@dataclass
class InferReport:
    """What `surgeon infer-wiring` found; ``exit_code`` 3 when the draft config's ids are missing
    or disagree with a wiring the evidence decides."""

    draft: str
    fc_tensor: str
    target: str
    num_layers: int
    hidden_size: int
    tokens: int
    search: Search
    ids: dict[str, IdList]
    stated_ids: dict[str, list[int]]
    stated_checks: list[StatedCheck]
    spec: str
    written: str | None = None
    notes: list[str] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)  # fc slots whose weights are all zero (they read nothing)

    @property
    def wiring(self) -> list[str]:
        return describe(self.search.points, self.search.wiring)

    @property
    def behaviour_decides(self) -> bool | None:
        s = self.search
        if s.behaviour_evaluations == 0:
            return None
        if s.behaviour_margin is None:  # a single candidate: nothing to lead
            return True
        best = next((c.divergence for c in s.candidates if c.wiring == s.wiring), None) or 0.0
        return (s.behaviour_z is not None and s.behaviour_z >= BEHAVIOUR_Z
                and s.behaviour_margin >= BEHAVIOUR_RELATIVE * best)

    @property
    def decided(self) -> bool:
        """Only the behaviour signal decides: the weight-space table is evidence for review (on an
        EAGLE-3 draft trained end to end with AdamW it has named wrong points by wide margins)."""
        return bool(self.behaviour_decides) and not self.dead

    @property
    def contradicted(self) -> list[int]:
        """Slots whose weight-space point differs from the point the decided behaviour signal names:
        that table's margins are not calibrated on this draft, so none of its slots is shown as
        deciding there (measured: an AdamW-trained draft's fc barely leaves its initialisation)."""
        if not self.behaviour_decides:
            return []
        s = self.search
        return [j for j, (a, b) in enumerate(zip(s.weight_wiring, s.wiring)) if a != b]

    @property
    def stated_agree(self) -> bool | None:
        checked = [r.agrees for r in self.stated_checks if r.agrees is not None]
        return all(checked) if checked else None

    @property
    def exit_code(self) -> int:
        """3 when the draft config states no ids (an engine then serves its default, whatever the
        wiring) or ids that disagree with a decided wiring; 4 when the evidence does not decide."""
        if not self.stated_ids:
            return 3
        if not self.decided or self.stated_agree is None:  # no verdict, or no engine could check the stated ids
            return UNDECIDED
        return 3 if self.stated_agree is False else 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def headline(self) -> str:
        """The first line: whether the evidence decides the wiring, and what the stated ids say."""
        s = self.search
        wiring = ", ".join(self.wiring)
        if self.dead:
            head = (f"undecided: fc slot(s) {', '.join(map(str, self.dead))} hold only zeros and read nothing, so no "
                    f"evidence names their point (it leans to {wiring})")
        elif self.decided:
            z = "" if s.behaviour_z is None else f" by {s.behaviour_z:.1f} standard errors"
            head = f"decided: the fc input is {wiring} (its behaviour leads every other wiring{z})"
        elif not s.behaviour_evaluations:
            head = (f"undecided: weight-space evidence alone, which does not decide (it leans to {wiring}); the "
                    "behaviour signal was not measured (see the notes)")
        else:
            runner = "-" if s.behaviour_runner_up is None else ", ".join(describe(s.points, s.behaviour_runner_up))
            z = "-" if s.behaviour_z is None else f"{s.behaviour_z:.1f}"
            head = (f"undecided: the behaviour of {wiring} does not lead the runner-up ({runner}) by the margin that "
                    f"decides ({z} standard errors): more or longer prompts")
        if not self.stated_ids:
            return head + "; the draft config states no ids, so each engine serves its default"
        if self.decided and self.stated_agree is False:
            return head + "; the ids the draft config states disagree with it"
        if self.decided and self.stated_agree:
            return head + "; the ids the draft config states agree"
        if self.decided:
            return head + "; the ids the draft config states could not be checked on any engine (see stated)"
        return head

    @property
    def n_slots(self) -> int:
        return len(self.search.slots)

    @property
    def weight_space(self) -> WeightSpaceVerdict:
        s = self.search
        against = set(self.contradicted)
        return WeightSpaceVerdict(describe(s.points, s.weight_wiring), s.weight_margin, s.weight_decides and not against,
                                  [SlotVerdict(x, x.slot in against) for x in s.slots])

    @property
    def behaviour(self) -> BehaviourVerdict | None:
        """The behaviour signal's verdict (None: not measured)."""
        s = self.search
        if not s.behaviour_evaluations:
            return None
        chosen = next((c for c in s.candidates if c.wiring == s.wiring), None)
        runner = next((c for c in s.candidates if c.wiring == s.behaviour_runner_up), None)
        return BehaviourVerdict(
            self.wiring, CHAIN_STEPS, None if chosen is None else chosen.divergence,
            None if chosen is None else chosen.agreement,
            None if s.behaviour_runner_up is None else describe(s.points, s.behaviour_runner_up),
            None if runner is None else runner.divergence, None if runner is None else runner.agreement,
            s.behaviour_margin, s.behaviour_z, self.behaviour_decides, s.behaviour_evaluations)

    @property
    def candidates(self) -> list[CandidateRow]:
        """The first 20 candidates, best first."""
        s = self.search
        return [CandidateRow(c.label, describe(s.points, c.wiring), c.weight_score, c.agreement, c.divergence)
                for c in s.candidates[:20]]

    @property
    def stated(self) -> StatedIds:
        return StatedIds(self.stated_ids, self.stated_agree, self.stated_checks)


def draft_runtime(draft: str, states: TargetStates, notes: list[str]) -> tuple[Eagle3Draft | None, Behaviour | None]:
    """The draft loaded as an EAGLE-3 model and its behaviour signal, or (None, None) with the
    reason in ``notes`` (a folder holding only an fc, a DFlash draft, another vocabulary)."""
    try:
        model = load_draft(draft, target=states.folder)
    except BadInput as e:
        notes.append(f"behaviour not measured: the draft does not load as an EAGLE-3 model ({e}); weight-space evidence only")
        return None, None
    vocab = target_config(states.folder)[3]
    if model.info.target_vocab_size != vocab:
        notes.append(f"behaviour not measured: the draft's target vocabulary is {model.info.target_vocab_size}, "
                     f"the target's {vocab}")
        return None, None
    need = sum(int(p.numel()) for p in states.input_ids) * vocab * 4 * 2  # the log-probs, and stacked by length
    if need > LOGPROB_BYTES:
        notes.append(f"behaviour not measured: the target's log-probabilities over these prompts would take "
                     f"{need >> 20} MiB (over {LOGPROB_BYTES >> 20} MiB); fewer or shorter prompts; weight-space "
                     "evidence only")
        return model, None
    return model, DraftBehaviour(model, states.input_ids, target_logprobs(states.folder, states.input_ids),
                                 CHAIN_STEPS)


def infer_wiring(draft: str, target: str, *, prompts: Sequence[torch.Tensor] | None = None,
                 behaviour: bool = True) -> InferReport:
    """The wiring ``draft``'s fc was trained on, against ``target`` (see the module docstring);
    with ``behaviour``, and a draft that loads as an EAGLE-3 model, the agreement search too."""
    fc = read_draft_fc(draft)
    states = collect_states(target, prompts)
    notes: list[str] = []
    if fc.weight.shape[1] % states.hidden_size:
        raise BadInput(f"{draft}: fc in_features {fc.weight.shape[1]} is not a multiple of the target's hidden_size "
                       f"{states.hidden_size}: this draft was not trained on {target}")
    P, N, H = states.states.shape
    dead = dead_slots(fc.weight, H)
    if dead:
        notes.append(f"fc slot(s) {dead} are all zeros: they read nothing, so neither the weights nor the behaviour "
                     "can name their point; the wiring is not decided")
    large = fc.weight.shape[0] * (fc.weight.shape[1] // H) * P * N * H > FULL_CONTRIBUTIONS_MACS
    contrib = None if large else contributions(fc.weight, states.states)
    if large:
        notes.append(f"large fc: the weight-space table is estimated through a {SKETCH}-wide sketch of its output side")
    named = named_wirings(fc.stated, states.architecture, states.num_layers, notes)
    model, signal = draft_runtime(draft, states, notes) if behaviour else (None, None)
    if not behaviour:
        notes.append("behaviour not measured (weight-space evidence only, as asked)")
    if signal is None:
        notes.append(WEIGHT_ONLY)
    fuse = None
    if model is not None and (model.fc_norm is not None or model.input_norm is not None):
        notes.append("the draft normalises its fc input: each candidate's fc output is computed by the draft's own fuse")
        fuse = _draft_fuse(model, states)
    elif model is not None and not _sums_match(model, Contributions(fc.weight, states.states, contrib), fc.bias, states):
        notes.append("the draft's fuse differs from the sum of its fc slots' contributions: each candidate's fc "
                     "output is computed by the draft's own fuse")
        fuse = _draft_fuse(model, states)
    found = search(fc.weight, states.states, states.points, contrib, named, bias=fc.bias, behaviour=signal, fuse=fuse,
                   sketch=SKETCH if large else None)
    text = spec_text(Path(draft).resolve().name, states, [states.points[i] for i in found.wiring], draft)
    stated_ids = {k: v for k, v in fc.stated.items() if v is not None}
    try:
        spec = load_spec("<inferred spec>", text=text)
        ids, stated = engine_ids(spec), stated_check(spec, draft)
    except SurgeonError as e:  # e.g. final_norm in a slot: no engine captures it as an fc input
        notes.append(f"the inferred wiring is not a servable spec ({str(e).splitlines()[0]}): no engine ids, "
                     "stated ids not checked")
        ids = {t: IdList(t, "", None, str(e).splitlines()[0], kind="refused") for t in RENDER_TARGETS}
        stated = []
    if not stated_ids:
        notes.append("the draft config states no ids (eagle_aux_hidden_state_layer_ids, eagle_config's, "
                     "dflash_config.target_layer_ids): every engine silently uses its default")
    return InferReport(fc.path, fc.tensor, states.source, states.num_layers, states.hidden_size,
                       states.states.shape[1], found, ids, stated_ids, stated, text, None, notes, dead)


def _draft_fuse(model: Eagle3Draft, states: TargetStates) -> Callable[[Wiring], torch.Tensor]:
    def fuse(w: Wiring) -> torch.Tensor:
        with torch.no_grad():
            return model.fuse([states.states[i] for i in w])

    return fuse


def _sums_match(model: Eagle3Draft, contrib: Contributions, bias: torch.Tensor | None, states: TargetStates) -> bool:
    """Does the sum of per-slot contributions reproduce the draft's own fuse (checked on one wiring)?"""
    w = tuple(range(len(contrib.blocks)))
    direct = _draft_fuse(model, states)(w)
    return bool(torch.allclose(fused_output(contrib, w, bias), direct, rtol=1e-4, atol=1e-4 * float(direct.abs().max())))
