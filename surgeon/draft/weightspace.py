"""Weight-space evidence: which point each fc slot was trained on, read from the fc's weights alone.

An EAGLE-3 fc is linear: ``fused = sum_j W_j s_j`` with ``W_j = fc.weight[:, j*H:(j+1)*H]`` and
``s_j`` the state fed to slot ``j``. Gradient training adds ``dW_j = sum_t g_t s_{j,t}^T`` to ``W_j``:
the update's rows are combinations of the very states the slot was fed, so over many steps its
amplification matrix ``M_j = W_j^T W_j`` grows like ``c C_p + (initialisation)``, with ``C_p`` the
covariance of the states at the point ``p`` it was trained on (its uncentred second moment).

The score of (slot ``j``, point ``p``) is the *alignment* of the two matrices::

    alignment(j, p) = <M_j - mu_j I, C_p>_F / (mu_j ||C_p||_F),   mu_j = ||W_j||_F^2 / H
                    = (gain(j, p) - 1) * tr(C_p) / ||C_p||_F

proportional (per slot) to the cosine between ``M_j`` with its isotropic part removed (a random
initialisation is isotropic) and ``C_p``; by Cauchy-Schwarz it is largest where ``C_p`` is shaped
like what the slot was trained on, so a point with fewer directions (the embedding under a shallow
layer) or more (a deeper layer) scores lower. ``gain(j, p) = ||S_p W_j^T||_F^2 H / (||W_j||_F^2
||S_p||_F^2)`` is the fc's output energy on the point's states over that on isotropic states of
the same energy, from the slot contributions ``S_p W_j^T`` (one matmul per slot over every point,
what the behaviour search needs anyway). ``||C_p||_F`` is estimated without the bias a few hundred
tokens give it (``||S S^T||_F^2`` over-counts ``tr(C)^2 / N``): the U-statistic over token pairs.
A score is relative to its slot: the margin is ``(best - runner_up) / best``.

Measured here (``tests/draft/test_weightspace.py``): on a 6-layer tiny Llama with an fc trained by
Adam on three known points, the true point leads every slot by 19-230% on prompts it was not
trained on (the gain alone: 2-43%, and it put the embedding level with layer_out[0]). Where the
evidence does not decide, the margin says so (under :data:`DECIDES`):

* the last layer's output and the final norm (a per-token rescaling of it) score within 2%;
* ``benchmarks/infer_wiring.py`` (synthetic Kimi-shaped streams, 128 tokens): with consecutive
  points 20% apart every slot is named right, by 1-4%, so reported as not deciding; 5% apart,
  nothing decides. The behaviour signal is what decides those.

And where the theory does not hold the margins are not calibrated: on an EAGLE-3 draft trained
end to end with AdamW (``surgeon.draft.synthetic``'s seed draft: 300 steps, every parameter, a
per-coordinate step size that does not keep the update in the span of the states) the table named
wrong points for all three slots, by margins of 5-54%. So ``surgeon infer-wiring`` shows this
table as evidence for review and lets only the behaviour signal decide (``surgeon.draft.infer``),
and a slot the decided behaviour contradicts is shown as contradicted, never as deciding.

Why, measured on that draft: its fc hardly leaves its initialisation. The output energy per unit
of input, ``||S_p W_j^T||^2 / ||S_p||^2``, is 0.05-0.28 over the points, against 0.111 expected of
``nn.Linear``'s initialisation (64 outputs x 1 / (3 x 192)); centred, 0.04-0.12; after whitening
each point's states, 0.06-0.11 and flat. The draft learns in its decoder layer, and the fc's
differences between points are its initialisation's noise and the states' mean directions. No
score tried (alignment, gain, centred gain, whitened gain, output norm) named the trained points
on the three drafts measured; the chained divergence named all three.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from surgeon.core.errors import BadInput
from surgeon.core.points import Point

#: relative margin (best / runner-up - 1) at or above which the weight-space signal names a slot's
#: point; below it the evidence does not decide between the two.
DECIDES = 0.05


@dataclass(frozen=True)
class SlotScore:
    """One slot's weight-space verdict: its best point, the runner-up, and the relative margin."""

    slot: int
    best: Point
    best_score: float
    runner_up: Point | None
    runner_up_score: float | None

    @property
    def margin(self) -> float | None:
        """``(best - runner_up) / best``; None with a single candidate point, or when no point
        aligns with the slot at all (best <= 0)."""
        if self.runner_up_score is None or self.best_score <= 0:
            return None
        return (self.best_score - self.runner_up_score) / self.best_score

    @property
    def decides(self) -> bool:
        if self.runner_up is None:
            return self.best_score > 0
        return self.margin is not None and self.margin >= DECIDES


def slot_blocks(weight: torch.Tensor, hidden_size: int) -> list[torch.Tensor]:
    """The fc weight's per-slot blocks ``W_j`` ``[out, H]``; BadInput unless in_features is a whole
    number of slots of the target's width."""
    if weight.dim() != 2:
        raise BadInput(f"the fc weight has shape {list(weight.shape)}, expected [out, n_slots * hidden]")
    n, rem = divmod(weight.shape[1], hidden_size)
    if rem or n < 1:
        raise BadInput(f"the fc weight has in_features {weight.shape[1]}, not a multiple of the target's "
                       f"hidden_size {hidden_size}: this draft was not trained on this target's states")
    return [weight[:, j * hidden_size:(j + 1) * hidden_size] for j in range(n)]


def contributions(weight: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """``out[j, p] = S_p W_j^T`` for every slot ``j`` and point ``p``: ``[n_slots, P, N, out]``
    from ``states`` ``[P, N, H]``. One matmul per slot over all points stacked; a candidate
    wiring's fc output is then a sum of ``n_slots`` of these (plus the fc bias, if any)."""
    P, N, H = states.shape
    blocks = slot_blocks(weight, H)
    flat = states.reshape(P * N, H).to(weight.dtype)
    out = torch.empty(len(blocks), P, N, weight.shape[0], dtype=weight.dtype)
    for j, block in enumerate(blocks):
        torch.matmul(flat, block.T, out=out[j].view(P * N, -1))
    return out


def _frobenius(states: torch.Tensor) -> torch.Tensor:
    """``||C_p||_F`` per point from its ``N`` tokens: sqrt of the U-statistic
    ``sum_{t != u} (x_t . x_u)^2 / (N (N - 1))``, unbiased for ``tr(C_p^2)``."""
    P, N, _ = states.shape
    out = torch.zeros(P, dtype=torch.float64)
    for p in range(P):
        gram = states[p].double() @ states[p].double().T
        pairs = gram.square().sum() - gram.diagonal().square().sum()
        out[p] = (pairs / max(N * (N - 1), 1)).clamp_min(1e-300).sqrt()
    return out


def _output_energy(weight: torch.Tensor, states: torch.Tensor, contrib: torch.Tensor | None,
                   sketch: int | None, seed: int) -> torch.Tensor:
    """``||S_p W_j^T||_F^2`` ``[n_slots, P]``: from the contributions, or estimated through a
    Gaussian sketch of the fc's output side (:func:`alignment_table`)."""
    P, N, H = states.shape
    blocks = slot_blocks(weight, H)
    if sketch is None or sketch >= weight.shape[0]:  # a sketch as wide as the output saves nothing
        if contrib is None:
            contrib = contributions(weight, states)
        return torch.stack([contrib[j].double().square().sum(dim=(1, 2)) for j in range(len(blocks))])
    g = torch.Generator().manual_seed(seed)
    projection = torch.randn(weight.shape[0], sketch, generator=g, dtype=weight.dtype) / sketch ** 0.5
    flat = states.reshape(P * N, H).to(weight.dtype)
    return torch.stack([(flat @ (block.T @ projection)).double().square().view(P, N, sketch).sum(dim=(1, 2))
                        for block in blocks])


def alignment_table(weight: torch.Tensor, states: torch.Tensor, contrib: torch.Tensor | None = None, *,
                    sketch: int | None = None, seed: int = 0) -> torch.Tensor:
    """``[n_slots, P]`` alignments (module docstring) of every slot against every point.

    With ``sketch``, ``||S_p W_j^T||^2`` is estimated as ``||S_p W_j^T R||^2`` with ``R`` a
    Gaussian ``[out, sketch] / sqrt(sketch)``, never forming the ``[N, out]`` contributions: cost
    ``n_slots * H * (out + P * N) * sketch`` instead of ``n_slots * P * N * H * out`` (Kimi
    shape, 7168 wide, 63 points x 128 tokens, sketch 512: ~0.3 TFLOP instead of 2.5). One ``R``
    serves every (slot, point), so its errors are shared and comparisons are tighter than each
    estimate (about ``sqrt(2 / (sketch * r))`` relative, r the stable rank of ``S_p W_j^T``)."""
    P, N, H = states.shape
    blocks = slot_blocks(weight, H)
    energy = _output_energy(weight, states, contrib, sketch, seed)
    state_energy = states.double().square().sum(dim=(1, 2))  # N tr(C_p)
    frob = _frobenius(states)
    table = torch.zeros(len(blocks), P, dtype=torch.float64)
    for j, block in enumerate(blocks):
        mu = block.double().square().sum() / H
        if mu > 0:  # an all-zero slot reads nothing: it aligns with no point (0), never 0/0
            table[j] = (energy[j] / mu - state_energy) / (N * frob)
    if not bool(torch.isfinite(table).all()):
        raise BadInput("the fc's alignment with the target's states is not finite (weights or states too large "
                       "for float64): no weight-space evidence")
    return table


def dead_slots(weight: torch.Tensor, hidden_size: int) -> list[int]:
    """The fc slots whose weights are all zero: they read nothing, so neither the weights nor the
    behaviour can say which point they were trained on."""
    return [j for j, block in enumerate(slot_blocks(weight, hidden_size)) if not bool(block.any())]


def slot_scores(table: torch.Tensor, points: Sequence[Point]) -> list[SlotScore]:
    """Each slot's best point and runner-up from an alignment table."""
    scores = []
    for j in range(table.shape[0]):
        order = torch.argsort(table[j], descending=True).tolist()
        best = order[0]
        second = order[1] if len(order) > 1 else None
        scores.append(SlotScore(j, points[best], float(table[j, best]),
                                None if second is None else points[second],
                                None if second is None else float(table[j, second])))
    return scores

