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

Beside it, a signal that does not saturate: the KL from the target's next-token distribution to the
draft's at every step of every chain (nats, summed over the ``K`` steps, mean over chains). Greedy
acceptance of a draft that copies well saturates at ``K`` for the trained wiring and its
single-slot neighbours alike (measured on ``surgeon.draft.synthetic``'s seed draft: 3.00 for the
trained wiring and four of its neighbours); the divergence still orders them. It needs the
target's log-probabilities at every position, kept only while they fit ``LOGPROB_BYTES``.

The target's states are captured ONCE per prompt (``capture_reference``, every point) and reused
for every wiring; only the draft runs once per wiring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from surgeon.core.errors import UNDECIDED, BadInput
from surgeon.core.points import EMBED, FINAL_NORM, Point, all_points, layer_out
from surgeon.core.safefile import read_text
from surgeon.core.shapes import Reads
from surgeon.core.spec import Spec
from surgeon.draft.behaviour import LOGPROB_BYTES, kl_to_draft
from surgeon.draft.model import DraftInfo, Eagle3Draft, chained_logits, one_thread
from surgeon.verify.reference import require_finite

DEFAULT_PROMPTS = 32
DEFAULT_PROMPT_LEN = 16
DEFAULT_LENGTH = 128
#: the target's log-probabilities are kept for the divergence column while they fit in this
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
    divergence: float | None = None  # nats per chain, summed over the K steps (module docstring)

    name = Reads("wiring.name")
    why = Reads("wiring.why")

    @property
    def points(self) -> list[str | None]:
        """The wiring's points as written (None: never captured)."""
        return [None if p is None else str(p) for p in self.wiring.points]

    note = Reads("wiring.note")

    @property
    def accept_length(self) -> float | None:
        """``1 + expected_accepted``: the target's bonus token counted (module docstring)."""
        return None if self.expected_accepted is None else 1 + self.expected_accepted


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
    logprobs: torch.Tensor | None = None  # [T, V] the target's next-token log-probabilities (None: not kept)


#: a prompts file is read whole: at most this many bytes
MAX_PROMPTS_BYTES = 16 << 20


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
        kl = [0.0, 0]
        with torch.no_grad():
            for pr in prompts:
                hits, div = _chain_hits(draft, pr, [pr.states[p] for p in w.points if p is not None], steps,
                                        f"{draft.info.path}: under the {w.name} wiring")
                tally.add(hits)
                if div is not None:
                    kl[0] += float(div.sum())
                    kl[1] += int(div.numel())
        divergence = kl[0] / kl[1] if kl[1] and all(pr.logprobs is not None for pr in prompts) else None
        results.append(WiringResult(w, tally.per_position(), tally.expected_accepted(), tally.chains,
                                    divergence=divergence))
    return results


def measure_one_thread(*args: Any, **kwargs: Any) -> list[WiringResult]:
    """:func:`measure` on one torch thread (tiny matrices; measured several times faster on a busy
    2-core machine than two threads contending)."""
    with one_thread():
        return measure(*args, **kwargs)


def _chain_hits(draft: Eagle3Draft, pr: PromptStates, slots: list[torch.Tensor],
                steps: int, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[K, n] hits of the chains that start in the continuation: chain ``t`` (from the target's
    state at ``t``) step ``j`` guesses the target's greedy token after ``t+1+j``; and [n] each
    chain's KL from the target's distributions, summed over its steps (None without log-probs).
    Logits with a NaN or +inf (a forward that overflows) are NotFinite: an argmax over them is no
    guess (-inf is a token outside the draft's vocabulary, as it should be)."""
    T = pr.ids.shape[0]
    logits = chained_logits(draft, draft.fuse(slots), pr.ids, steps)
    require_finite([(f"the draft's step-{j + 1} logits", x.masked_fill(torch.isneginf(x), 0.0))
                    for j, x in enumerate(logits)], where)
    starts = torch.arange(max(pr.prompt_len - 1, 0), T - 1 - steps)
    if starts.numel() == 0:
        return torch.zeros(steps, 0, dtype=torch.bool), None
    hits = torch.stack([logits[j][starts].argmax(-1) == pr.greedy[starts + 1 + j] for j in range(steps)])
    if pr.logprobs is None:
        return hits, None
    div = torch.zeros(starts.numel(), dtype=torch.float64)
    for j in range(steps):
        target = pr.logprobs[starts + 1 + j]
        div += kl_to_draft(target, logits[j][starts]).double()
    return hits, div


# -- a whole run ----------------------------------------------------------------------------


SEPARATION = 2.0  # standard errors of the difference of two position-1 acceptance rates


@dataclass
class AcceptReport:
    spec: str
    draft: str
    target: str
    steps: int
    prompts: str  # where the prompts came from (the rule, or the file)
    n_prompts: int
    length: int
    info: DraftInfo
    rows: list[WiringResult]
    notes: list[str]
    min_rate: float | None = None
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def spec_row(self) -> WiringResult:
        return self.rows[0]

    @property
    def above_min(self) -> bool:
        per = self.spec_row.per_position
        return self.min_rate is None or (per is not None and per[0] >= self.min_rate)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def exit_code(self) -> int:
        """3 when the spec's position-1 acceptance is below ``--min``, its wiring cannot be served,
        or another wiring accepts more; 4 when another accepts as much (these prompts do not decide)."""
        verdict = self.verdict
        if not self.above_min or verdict in ("better", "not_run"):
            return 3
        return UNDECIDED if verdict == "undecided" else 0

    def rivals(self) -> tuple[list[WiringResult], list[WiringResult]]:
        """(alternatives whose position-1 acceptance the spec's does not beat by ``SEPARATION``
        standard errors of the two proportions, those of them that beat the spec's by as much):
        the wirings these prompts cannot tell from the spec's, or that serve the draft better."""
        me = self.spec_row
        if me.per_position is None or not me.chains:
            return [], []
        p, n = me.per_position[0], me.chains
        close, better = [], []
        for r in self.rows[1:]:
            if r.per_position is None or not r.chains or r.wiring.points == me.wiring.points:
                continue
            q, m = r.per_position[0], r.chains
            se = math.sqrt(max(p * (1 - p) / n + q * (1 - q) / m, 1e-12))
            if q - p > SEPARATION * se:
                better.append(r)
            elif p - q <= SEPARATION * se:
                close.append(r)
        return close, better

    @property
    def verdict(self) -> str:
        """``better``: another wiring accepts more than the spec's; ``undecided``: one accepts as
        much within the noise of these prompts; ``separated``: the spec's beats every other;
        ``not_run``: the spec's wiring cannot be served."""
        if self.spec_row.per_position is None:
            return "not_run"
        close, better = self.rivals()
        return "better" if better else "undecided" if close else "separated"

    @property
    def headline(self) -> str:
        me = self.spec_row
        if me.per_position is None:
            return f"not run: the spec's wiring cannot be served ({me.not_servable})"
        close, better = self.rivals()
        head = f"the spec's wiring accepts {me.per_position[0]:.1%} at position 1"
        if better:
            return (f"better: {', '.join(r.wiring.name for r in better)} accept{'s' if len(better) == 1 else ''} more "
                    f"than the spec's wiring (beyond {SEPARATION:g} standard errors): {head}")
        if close:
            return (f"undecided: {', '.join(r.wiring.name for r in close)} accept{'s' if len(close) == 1 else ''} as "
                    f"much within {SEPARATION:g} standard errors of {me.chains} chains, so these prompts do not tell "
                    f"{'it' if len(close) == 1 else 'them'} from the spec's wiring: {head}")
        return f"separated: {head}, more than every other wiring by {SEPARATION:g} standard errors"

    @property
    def min(self) -> float | None:
        """``--min``: the position-1 acceptance the spec's wiring must reach (None: not asked)."""
        return self.min_rate

    @property
    def draft_info(self) -> dict[str, Any]:
        return asdict(self.info)

    @property
    def sampling(self) -> str:
        """Where sampling would differ from this greedy measure (module docstring)."""
        return SAMPLING_NOTE

    @property
    def wirings(self) -> list[WiringResult]:
        """The spec's wiring first, then the miswirings."""
        return self.rows


def read_prompts(path: str | Path, vocab: int) -> list[list[int]]:
    """One prompt per non-empty line: token ids separated by spaces or commas, or a JSON list."""
    import json

    p = Path(path)
    try:
        text = read_text(p, limit=MAX_PROMPTS_BYTES, what="the prompts file")
    except FileNotFoundError:
        raise BadInput(f"{p}: no such prompts file") from None
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            values = json.loads(s) if s.startswith("[") else [int(v) for v in s.replace(",", " ").split()]
        except ValueError:
            raise BadInput(f"{p}:{n}:1: a prompt is token ids (integers separated by spaces or commas, or a JSON list)") from None
        if not isinstance(values, list) or not values or not all(type(v) is int and 0 <= v < vocab for v in values):
            raise BadInput(f"{p}:{n}:1: a prompt is a non-empty list of token ids in 0..{vocab - 1}")
        prompts.append(values)
    if not prompts:
        raise BadInput(f"{p}: no prompts (one line of token ids per prompt)")
    return prompts


def seeded_prompts(vocab: int, n: int, length: int, seed: int) -> tuple[list[list[int]], str]:
    g = torch.Generator().manual_seed(seed)
    k = min(length, vocab)
    prompts = [torch.randperm(vocab, generator=g)[:k].tolist() for _ in range(n)]
    return prompts, (f"{n} prompts of {k} distinct token ids drawn uniformly from the target's vocabulary "
                     f"0..{vocab - 1} (torch.randperm, seed {seed})")


def target_states(target_dir: Path, prompts: list[list[int]], length: int) -> tuple[list[PromptStates], list[str]]:
    """Each prompt continued greedily by the target to ``length`` tokens, then its states at every
    point captured ONCE, by the hooks ``capture_reference`` uses (its recorder and structure
    checks, on a model loaded once instead of once per prompt); the greedy labels are the argmax
    of the target's LM head over the captured ``final_norm``. A note reports positions where the
    generated token is not that argmax (numerics of the cached generation)."""
    from surgeon.core.points import FINAL_NORM as FN
    from surgeon.verify.reference import ForwardRecorder, checked_structure, load_model

    model = load_model(target_dir, torch.float32).eval()
    head = model.get_output_embeddings().weight.detach().float()
    require_finite([("the LM head's weight", head)], str(target_dir))
    continued = _continue_greedily(model, prompts, length)
    keep = sum(int(c.numel()) for c in continued) * head.shape[0] * 4 <= LOGPROB_BYTES
    out, flips = [], 0
    with one_thread():
        for prompt, seq in zip(prompts, continued, strict=True):
            layers, norm = checked_structure(model, target_dir, seq)
            recorder = ForwardRecorder(len(layers))
            recorder.record(model, layers, norm, seq)
            recorder.check_plain_residual_stack(target_dir)
            states = recorder.states()
            require_finite(((f"state {p}", t) for p, t in states.items()), f"{target_dir} (run on a prompt)")
            logits = states[FN] @ head.T
            greedy = logits.argmax(-1)
            P = len(prompt)
            flips += int((seq[P:] != greedy[P - 1:-1]).sum())
            out.append(PromptStates(seq, P, states, greedy, torch.log_softmax(logits, -1) if keep else None))
    notes = [f"{flips} generated tokens differ from the target's argmax on the full forward (numerics); "
             "labels are the full forward's argmax"] if flips else []
    if not keep:
        notes.append(f"divergence not measured: the target's log-probabilities would take over {LOGPROB_BYTES >> 20} MiB")
    return out, notes


def _continue_greedily(model: Any, prompts: list[list[int]], length: int) -> list[torch.Tensor]:
    """Each prompt continued by the target's greedy decoding to ``length`` tokens; prompts of one
    length are decoded as one batch (no padding, so each row is what it would be alone)."""
    from surgeon.verify.reference import quiet_transformers

    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    with one_thread(), torch.no_grad(), quiet_transformers():
        for n, members in groups.items():
            ids = torch.tensor([prompts[i] for i in members], dtype=torch.int64)
            new = max(length - n, 0)
            seqs = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=0) if new else ids
            for row, i in enumerate(members):
                out[i] = seqs[row]
    return out


def run_accept(spec: Spec, draft_dir: str | Path, target: str | Path, *, prompts_file: str | Path | None = None,
               steps: int = 3, min_rate: float | None = None, n_prompts: int = DEFAULT_PROMPTS,
               prompt_len: int = DEFAULT_PROMPT_LEN, length: int = DEFAULT_LENGTH, seed: int = 0,
               engines: Sequence[str] = ("vllm", "sglang")) -> AcceptReport:
    """Acceptance of ``draft_dir`` on ``target`` under the spec's wiring and the bug wirings."""
    import time

    from surgeon.draft.model import load_draft
    from surgeon.verify.reference import resolve_model

    if steps < 1:
        raise BadInput(f"--steps must be at least 1, got {steps}")
    if length < 1:
        raise BadInput(f"--length is tokens per prompt, at least 1, got {length}")
    if min_rate is not None and not 0 <= min_rate <= 1:
        raise BadInput(f"--min is an acceptance rate in 0..1, got {min_rate}")
    t0 = time.perf_counter()
    target_dir, label = resolve_model(str(target)[3:] if str(target).startswith("hf:") else target)
    draft = load_draft(draft_dir, target=target_dir)
    if draft.info.n_slots != len(spec.fc_points):
        raise BadInput(f"{draft_dir}: the draft's fc takes {draft.info.n_slots} slots, the spec's fc_input lists "
                       f"{len(spec.fc_points)}")
    vocab = draft.info.target_vocab_size
    if prompts_file is not None:
        prompts, source = read_prompts(prompts_file, vocab), f"file {prompts_file}"
    else:
        prompts, source = seeded_prompts(vocab, n_prompts, prompt_len, seed)
    states, notes = target_states(target_dir, prompts, length)
    if all(pr.ids.shape[0] - steps <= pr.prompt_len for pr in states):  # no chain starts in a continuation
        raise BadInput(f"--length {length}: no prompt is continued past its own tokens plus {steps} draft steps, so "
                       "there is no chain to measure (a rate from none would be a made-up number); a longer --length")
    L = len([p for p in states[0].states if p.kind == "layer_out"])
    if L != spec.num_layers:
        raise BadInput(f"{spec.file}: the spec says {spec.num_layers} layers, the target {label} has {L}")
    t1 = time.perf_counter()
    wirings = bug_wirings(spec.fc_points, L)
    more, engine_notes = engine_wirings(spec, Path(draft_dir), engines)
    wirings = _dedup(wirings + more)
    if all(v is None for v in draft.info.stated_ids.values()):
        notes.append("the draft's config states no aux layer ids: every engine serves it its default ids "
                     "(see the 'serves' rows)")
    rows = measure_one_thread(draft, states, wirings, steps)
    t2 = time.perf_counter()
    return AcceptReport(spec=spec.name, draft=str(draft_dir), target=label, steps=steps, prompts=source,
                        n_prompts=len(prompts), length=length, info=draft.info, rows=rows,
                        notes=notes + engine_notes + list(draft.info.notes), min_rate=min_rate,
                        timings_s={"target": round(t1 - t0, 3), "draft": round(t2 - t1, 3)})
