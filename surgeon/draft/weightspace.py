"""Weight-space evidence: which point each fc slot was trained on, read from the fc's weights alone.

An EAGLE-3 fc is linear: ``fused = sum_j W_j s_j`` with ``W_j = fc.weight[:, j*H:(j+1)*H]`` and
``s_j`` the state fed to slot ``j``. Gradient training adds ``dW_j = sum_t g_t s_{j,t}^T`` to ``W_j``:
the update's rows are combinations of the very states the slot was fed, weighted by how often each
direction occurs. So ``W_j`` has its energy in the directions its training states vary in, and the
point it was trained on is the one whose states it amplifies most.

The score of (slot ``j``, point ``p``) is that amplification, the *gain*::

    gain(j, p) = ||S_p W_j^T||_F^2 / (||W_j||_F^2 * ||S_p||_F^2 / H)

with ``S_p`` the target's states at ``p`` (rows: tokens of a few prompts, ``[N, H]``). It is the
fc's output energy on the real states over its output energy on isotropic states of the same total
energy: 1 for a ``W_j`` that ignores the data's geometry (a random initialisation scores 1 at every
point in expectation), above 1 where ``W_j``'s rows lie in ``S_p``'s high-variance subspace. It has
no rank to choose and it is computed from the slot contributions ``S_p W_j^T``, which the behaviour
search needs anyway: one matmul per slot over every point, whatever the number of candidate wirings.

Measured here (``tests/draft/test_weightspace.py``): on a 6-layer tiny Llama with an fc trained by
Adam on three known points, the true point leads every slot by 9-43% on prompts it was not trained
on. Where it does not decide, the margin says so (under :data:`DECIDES`):

* the last layer's output and the final norm (a per-token rescaling of it) score within 2%;
* the gain is an energy-weighted mean of the fc's amplification, so a point holding only the
  most amplified directions (the embedding, when deeper layers add directions of their own that
  the fc amplifies less) can lead the point the slot was trained on by a little: in
  ``benchmarks/infer_wiring.py`` (synthetic Kimi-shaped streams, consecutive points 20% apart) a
  slot trained on layer_out[2] scores embed 1.3% higher, while layer_out[30] and layer_out[58]
  are named right with 2-3% margins; all three are reported as not deciding, never as a verdict.
  With consecutive points 5% apart no slot decides. The behaviour signal is what decides those.
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
    best_gain: float
    runner_up: Point | None
    runner_up_gain: float | None

    @property
    def margin(self) -> float | None:
        """``best / runner_up - 1`` (None with a single candidate point)."""
        if self.runner_up_gain is None:
            return None
        return self.best_gain / max(self.runner_up_gain, 1e-30) - 1.0

    @property
    def decides(self) -> bool:
        return self.margin is None or self.margin >= DECIDES


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


def gain_table(weight: torch.Tensor, states: torch.Tensor, contrib: torch.Tensor | None = None) -> torch.Tensor:
    """``[n_slots, P]`` gains (see the module docstring) of every slot against every point."""
    P, N, H = states.shape
    blocks = slot_blocks(weight, H)
    if contrib is None:
        contrib = contributions(weight, states)
    state_energy = states.double().square().sum(dim=(1, 2))  # [P]
    table = torch.zeros(len(blocks), P, dtype=torch.float64)
    for j, block in enumerate(blocks):
        w_energy = block.double().square().sum()
        out_energy = contrib[j].double().square().sum(dim=(1, 2))  # [P]
        table[j] = out_energy * H / (w_energy * state_energy).clamp_min(1e-300)
    return table


def slot_scores(table: torch.Tensor, points: Sequence[Point]) -> list[SlotScore]:
    """Each slot's best point and runner-up from a gain table."""
    scores = []
    for j in range(table.shape[0]):
        order = torch.argsort(table[j], descending=True).tolist()
        best = order[0]
        second = order[1] if len(order) > 1 else None
        scores.append(SlotScore(j, points[best], float(table[j, best]),
                                None if second is None else points[second],
                                None if second is None else float(table[j, second])))
    return scores


def sketched_gain_table(weight: torch.Tensor, states: torch.Tensor, width: int = 512, seed: int = 0) -> torch.Tensor:
    """:func:`gain_table` with the fc's output side sketched by a Gaussian ``[out, width]`` matrix
    ``R / sqrt(width)``: ``||S_p W_j^T R||^2`` estimates ``||S_p W_j^T||^2`` without forming the
    ``[N, out]`` contributions, so the cost is ``n_slots * H * (out + P * N) * width`` instead of
    ``n_slots * P * N * H * out`` (at Kimi size, 7168 wide, 63 points x 128 tokens: ~0.3 TFLOP
    instead of 2.5). One sketch serves every (slot, point), so the estimates' errors are shared and
    the comparisons between points are tighter than each estimate (about ``sqrt(2 / (width * r))``
    relative, r the stable rank of ``S_p W_j^T``)."""
    P, N, H = states.shape
    blocks = slot_blocks(weight, H)
    g = torch.Generator().manual_seed(seed)
    sketch = torch.randn(weight.shape[0], width, generator=g, dtype=weight.dtype) / width ** 0.5
    flat = states.reshape(P * N, H).to(weight.dtype)
    state_energy = states.double().square().sum(dim=(1, 2))
    table = torch.zeros(len(blocks), P, dtype=torch.float64)
    for j, block in enumerate(blocks):
        projected = block.T @ sketch  # [H, width]
        out_energy = (flat @ projected).double().square().view(P, N, width).sum(dim=(1, 2))
        table[j] = out_energy * H / (block.double().square().sum() * state_energy).clamp_min(1e-300)
    return table
