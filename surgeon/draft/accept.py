"""Teacher-forced acceptance of an EAGLE-3 draft under its spec's wiring and the wirings bugs produce.

As the engines count it, greedy: at every position ``t`` of the target's own greedy continuation
of a prompt, the draft proposes ``K`` tokens in a chain (step 1 fed the target's states at ``t``
fused by the fc and the token at ``t+1``; steps 2..K fed the draft's own hidden output back, as
``surgeon.draft.model`` documents from SpecForge's source); the target accepts the longest prefix
that equals its own greedy tokens. Per-position acceptance ``P(accepted > j)`` is vLLM's
"per-position acceptance rate" (accepted tokens at position ``j`` over drafts); the accept length
counts the target's bonus token too (``1 + E[accepted]``), as SGLang's ``accept length`` and
vLLM's "mean acceptance length" do.

Where sampling would differ: with temperature > 0 the engines accept a draft token with
probability ``min(1, p_target / p_draft)`` (rejection sampling), so acceptance depends on both
distributions, not only on argmax agreement; that is not modelled here.

The target's states are captured ONCE per prompt (``capture_reference``, every point) and reused
for every wiring; only the draft runs once per wiring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from surgeon.core.errors import BadInput
from surgeon.core.points import EMBED, FINAL_NORM, Point, all_points, layer_out
from surgeon.core.spec import Spec
from surgeon.draft.model import Eagle3Draft, one_thread, teacher_forced

DEFAULT_PROMPTS = 32
DEFAULT_PROMPT_LEN = 16
DEFAULT_LENGTH = 128
SAMPLING_NOTE = ("greedy: with sampling (temperature > 0) engines accept a draft token with probability "
                 "min(1, p_target/p_draft) (rejection sampling); that depends on both distributions and is not modelled")


@dataclass
class Wiring:
    name: str
    why: str
    points: list[Point | None]  # None: the engine captures nothing for that slot
    note: str | None = None

    def servable(self, n_slots: int) -> str | None:
        """Why this wiring cannot even run (None: it can)."""
        if len(self.points) != n_slots:
            return f"{len(self.points)} captured states for {n_slots} fc slots: the fc input has the wrong width"
        if any(p is None for p in self.points):
            return "a slot is never captured"
        return None


@dataclass
class Tally:
    """Accepted-length counts over chains: ``counts[a]`` chains accepted exactly ``a`` tokens."""

    steps: int
    counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (self.steps + 1)

    def add(self, correct: torch.Tensor) -> None:
        """``correct`` [K, n] bools: step j of chain i proposed the target's token."""
        accepted = torch.cumprod(correct.to(torch.int64), dim=0).sum(0)
        for a, c in zip(*torch.unique(accepted, return_counts=True), strict=True):
            self.counts[int(a)] += int(c)

    @property
    def chains(self) -> int:
        return sum(self.counts)

    def per_position(self) -> list[float]:
        n = max(self.chains, 1)
        return [sum(self.counts[j + 1:]) / n for j in range(self.steps)]

    def expected_accepted(self) -> float:
        return sum(self.per_position())


@dataclass
class WiringResult:
    wiring: Wiring
    per_position: list[float] | None
    expected_accepted: float | None
    chains: int
    not_servable: str | None = None

    def to_json(self) -> dict[str, Any]:
        w = self.wiring
        return {"name": w.name, "why": w.why, "points": [None if p is None else str(p) for p in w.points],
                "note": w.note, "not_servable": self.not_servable, "per_position": self.per_position,
                "expected_accepted": self.expected_accepted,
                "accept_length": None if self.expected_accepted is None else 1 + self.expected_accepted,
                "chains": self.chains}


# -- the wirings real bugs produce ----------------------------------------------------------


def _stream(L: int) -> list[Point]:
    return all_points(L)  # embed, layer_out[0..L-1], final_norm


def _neighbour(p: Point, L: int, d: int) -> Point | None:
    order = _stream(L)
    i = order.index(p) + d
    return order[i] if 0 <= i < len(order) else None


def bug_wirings(spec_points: Sequence[Point], L: int) -> list[Wiring]:
    """The spec's wiring, then the miswirings that need no engine: each slot off by one, the
    pre/post final-norm swap, slot order reversed, the labels shifted by a slot."""
    pts: list[Point | None] = list(spec_points)
    out = [Wiring("spec", "the spec's fc_input", list(pts))]
    for i, p in enumerate(spec_points):
        for d in (-1, 1):
            q = _neighbour(p, L, d)
            if q is not None:
                out.append(Wiring(f"slot {i} {'-' if d < 0 else '+'}1", f"slot {i} fed {q} instead of {p} (off by one)",
                                  pts[:i] + [q] + pts[i + 1:]))
    for i, p in enumerate(spec_points):
        swap = {FINAL_NORM: layer_out(L - 1), layer_out(L - 1): FINAL_NORM}.get(p)
        if swap is not None:
            out.append(Wiring(f"slot {i} norm swap", f"slot {i} fed {swap} instead of {p} (before/after the final norm, "
                              "speculators#313)", pts[:i] + [swap] + pts[i + 1:]))
    first: list[Point | None] = [EMBED]
    last: list[Point | None] = [FINAL_NORM]
    if pts[0] != EMBED:
        out.append(Wiring("embed in slot 0", "slot 0 fed embed (a layer_in/layer_out or embed label mix-up)",
                          first + pts[1:]))
    out.append(Wiring("reversed", "slot order reversed", pts[::-1]))
    out.append(Wiring("labels shifted +1", "deployed by labels one slot late: [embed] + the first n-1 (the Kimi-K2.5 case)",
                      first + pts[:-1]))
    out.append(Wiring("labels shifted -1", "deployed by labels one slot early: the last n-1 + [final_norm]",
                      pts[1:] + last))
    return _dedup(out)


def _dedup(wirings: list[Wiring]) -> list[Wiring]:
    seen: dict[tuple, Wiring] = {}
    for w in wirings:
        key = tuple(str(p) for p in w.points)
        if key in seen:
            first = seen[key]
            first.note = ((first.note + "; ") if first.note else "") + f"same points as '{w.name}'"
            continue
        seen[key] = w
    return list(seen.values())


def engine_wirings(spec: Spec, draft_dir: Path, engines: Sequence[str] = ("vllm", "sglang")) -> tuple[list[Wiring], list[str]]:
    """What each engine feeds the fc: from the draft config's ids as it reads them
    (``check-draft``), and from its default ids. Notes say what could not be decided."""
    from surgeon.engines.view import model_class_for, open_engine
    from surgeon.wiring.draft import check_draft

    L = spec.num_layers
    out: list[Wiring] = []
    notes: list[str] = []
    for engine in engines:
        try:
            report = check_draft(spec, draft_dir, engine)
            pts = [None if s is None else _parse(s, L) for s in report.captured]
            src = f"ids {report.ids_used} from {next(iter(report.ids_found), 'the config')}" if report.ids_used else \
                "the draft config states no ids: the engine's default"
            errors = "; ".join(f.detail for f in report.findings if f.severity == "error")
            out.append(Wiring(f"{engine} serves", f"{engine} ({report.model_class}) fed by {src}", pts,
                              note=errors or None))
            view = open_engine(engine, None)
            conv = view.convention(model_class_for(spec, engine, None))
            out.append(Wiring(f"{engine} default", f"{engine}'s default ids ({conv.origin})",
                              list(conv.default_points(L))))
        except BadInput as e:
            notes.append(f"{engine}: not evaluated ({e})")
    return out, notes


def _parse(text: str, L: int) -> Point:
    from surgeon.core.points import parse_point

    return parse_point(text, L, allow_delta=True)


# -- measuring ------------------------------------------------------------------------------


@dataclass
class PromptStates:
    """One prompt's continuation and the target's states at every point (captured once)."""

    ids: torch.Tensor  # [T]
    prompt_len: int
    states: dict[Point, torch.Tensor]  # [T, H]
    greedy: torch.Tensor  # [T] the target's argmax next token at each position


def measure(draft: Eagle3Draft, prompts: Sequence[PromptStates], wirings: Sequence[Wiring], steps: int,
            on_wiring: Callable[[str], None] | None = None) -> list[WiringResult]:
    """Acceptance of every wiring over every prompt (module docstring)."""
    n = draft.info.n_slots
    results = []
    for w in wirings:
        blocked = w.servable(n)
        if on_wiring:
            on_wiring(w.name)
        if blocked is not None:
            results.append(WiringResult(w, None, None, 0, blocked))
            continue
        tally = Tally(steps)
        with torch.no_grad():
            for pr in prompts:
                tally.add(_chain_hits(draft, pr, [pr.states[p] for p in w.points if p is not None], steps))
        results.append(WiringResult(w, tally.per_position(), tally.expected_accepted(), tally.chains))
    return results


def measure_one_thread(*args: Any, **kwargs: Any) -> list[WiringResult]:
    """:func:`measure` on one torch thread (tiny matrices; measured several times faster on a busy
    2-core machine than two threads contending)."""
    with one_thread():
        return measure(*args, **kwargs)


def _chain_hits(draft: Eagle3Draft, pr: PromptStates, slots: list[torch.Tensor], steps: int) -> torch.Tensor:
    """[K, n] hits of the chains that start in the continuation: chain ``t`` (from the target's
    state at ``t``) step ``j`` guesses the target's greedy token after ``t+1+j``."""
    T = pr.ids.shape[0]
    guesses = teacher_forced(draft, draft.fuse(slots), pr.ids, steps)
    starts = torch.arange(max(pr.prompt_len - 1, 0), T - 1 - steps)
    if starts.numel() == 0:
        return torch.zeros(steps, 0, dtype=torch.bool)
    return torch.stack([guesses[j][starts] == pr.greedy[starts + 1 + j] for j in range(steps)])
