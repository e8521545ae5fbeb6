"""The behaviour signal of an EAGLE-3 draft: how close its chained guesses are to the target's
next-token distribution, given the fc output of a candidate wiring (``surgeon.draft.infer``).

For every prompt, the draft runs ``steps`` chained teacher-forced steps with SpecForge's alignment
(:func:`surgeon.draft.model.teacher_forced`): step ``j`` pairs the chain that starts at the
target's state ``t`` with the embedding of token ``t+1+j`` and guesses token ``t+2+j``, whose
distribution is the target's at ``t+1+j``. The divergence of a prompt is the KL from that target
distribution to the draft's, averaged over the prompt's positions and summed over the steps: the
TTT loss SpecForge trains (``surgeon.draft.synthetic.chain_loss``) less the target's entropy and
without the step weights. It does not saturate as argmax agreement does. The step-1 top-1
agreement with the target's greedy token is reported beside it.

Prompts of equal length are run as one batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from surgeon.draft.model import DraftCache, Eagle3Draft, one_thread
from surgeon.verify.reference import require_finite

#: a draft log-probability of -inf (a token outside its vocabulary) counts as this, so the KL stays
#: finite; the term is the same for every wiring, so comparisons are unaffected
LOG_FLOOR = -50.0


def kl_to_draft(target_lp: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """KL(target || draft) per row, from the target's log-probabilities and the draft's logits (the
    draft's log-probabilities floored at :data:`LOG_FLOOR`, so a token it rules out costs a bounded
    amount; a token the target rules out, ``-inf``, contributes 0, never NaN)."""
    draft_lp = torch.log_softmax(draft_logits.float(), -1).clamp_min(LOG_FLOOR)
    p = target_lp.exp()
    return torch.where(p > 0, p * (target_lp - draft_lp), torch.zeros_like(p)).sum(-1)


# the target's log-probabilities [T, V] of every prompt are kept while the signal runs: at most this
LOGPROB_BYTES = 1 << 30


@dataclass(frozen=True)
class Evaluation:
    """A behaviour signal's reading of one wiring: ``divergence`` ``[n_prompts]`` (nats per chained
    position, lower is closer to the target) and the step-1 top-1 agreement (0..1)."""

    divergence: torch.Tensor
    agreement: float

    @property
    def mean(self) -> float:
        return float(self.divergence.mean())


def target_logprobs(folder: str, prompts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The target's next-token log-probabilities ``[T, V]`` at every position of each prompt."""
    from surgeon.verify.reference import load_model

    model = load_model(Path(folder), torch.float32).eval()
    with torch.no_grad():
        out = [torch.log_softmax(model(input_ids=ids[None], use_cache=False).logits[0].float(), -1) for ids in prompts]
    require_finite(((f"the target's log-probabilities on prompt {i}", lp.masked_fill(torch.isneginf(lp), 0.0))
                    for i, lp in enumerate(out)), folder)
    return out


class DraftBehaviour:
    """:class:`Evaluation` of a loaded draft over fixed prompts (module docstring). ``logprobs``:
    the target's, one ``[T, V]`` per prompt, in the prompts' order."""

    def __init__(self, draft: Eagle3Draft, prompts: Sequence[torch.Tensor], logprobs: Sequence[torch.Tensor],
                 steps: int = 3) -> None:
        self.draft, self.steps = draft, steps
        lengths = [int(p.numel()) for p in prompts]
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        by_len: dict[int, list[int]] = {}
        for i, T in enumerate(lengths):
            if T >= 2:
                by_len.setdefault(T, []).append(i)
        self.n = len(lengths)
        self.groups = [(T, idx, [starts[i] for i in idx], torch.stack([torch.as_tensor(prompts[i]) for i in idx]),
                        torch.stack([logprobs[i] for i in idx])) for T, idx in by_len.items()]

    def evaluate(self, fused: torch.Tensor) -> Evaluation:
        divergence = torch.zeros(self.n, dtype=torch.float64)
        hits = total = 0
        # one thread for tiny matrices (contention on a shared 2-core machine); all of them for large ones
        threads = one_thread() if self.draft.info.hidden_size <= 1024 else contextlib.nullcontext()
        with torch.no_grad(), threads:
            for T, idx, starts, ids, logp in self.groups:
                h = torch.stack([fused[s:s + T] for s in starts])
                cache = DraftCache()
                for j in range(min(self.steps, T - 1)):
                    n = T - 1 - j
                    step_ids = torch.zeros_like(ids)
                    step_ids[:, :n] = ids[:, 1 + j:]
                    out, h = self.draft.step(h, step_ids, cache)
                    target_lp = logp[:, 1 + j:]
                    kl = kl_to_draft(target_lp, out[:, :n]).mean(-1)
                    divergence[idx] += kl.double()
                    if j == 0:
                        hits += int((out[:, :n].argmax(-1) == target_lp.argmax(-1)).sum())
                        total += ids.shape[0] * n
        require_finite([("the divergence of a candidate wiring", divergence)],
                       f"{self.draft.info.path}: its forward on the target's finite states overflows")
        return Evaluation(divergence, hits / total if total else 0.0)
