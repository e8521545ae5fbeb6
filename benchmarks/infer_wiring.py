"""Benchmark: infer-wiring at Kimi-K2.5 shape against the naive search, in one run.

    .venv/bin/python benchmarks/infer_wiring.py [--json] [--tokens 128] [--hidden 7168] [--layers 61]
                                                [--gap 0.2] [--behaviour 2] [--sketch 512]

The case: a 61-layer target (63 points: embed, 61 layer_out, final_norm), hidden 7168, 128 tokens,
and an EAGLE-3 fc of 3 slots trained on layer_out[2], layer_out[30], layer_out[58] whose config
states them shifted by a slot (embed, layer_out[2], layer_out[30]), as in the Kimi-K2.5 incident.

* States are synthetic random-walk residual streams, not a real model: the embedding lives in a
  256-dimensional subspace and each layer adds an update in its own 16-dimensional one (a fixed
  random "model"), ``--gap`` times the stream's norm; final_norm is the RMS norm of the last
  layer's output.
* The fc is trained-shaped, not trained: a random initialisation plus, per slot, an update whose
  rows are distributed as that slot's training states (what many gradient steps add: their rows
  are combinations of the states fed to the slot), twice the initialisation's norm.
* Our search: the weight-space table of every slot against every point (sketched, ``--sketch``
  wide), each slot's best point, the structured candidates scored (what ``infer-wiring`` does
  without a draft runtime), then ``--behaviour`` K of the best candidates through the behaviour
  signal infer-wiring searches (``surgeon.draft.behaviour.DraftBehaviour``: ``CHAIN_STEPS``
  chained steps of a Kimi-shaped EAGLE-3 draft and the KL to a target distribution; random
  weights and a random target distribution: this times it, the values mean nothing), each
  candidate's fc output a sum of three per-slot contributions.
* The naive search: a full fc + the same chained draft forward per candidate wiring. Timed on 2 sample candidates
  and extrapolated to every ordered triple of distinct points (63 x 62 x 61 = 238,266): running
  it would take days, so it is estimated, and the output says so.

Draft shapes assumed (the Kimi-K2.5 EAGLE-3 draft's are close): hidden 7168, 56 heads of 128,
8 KV heads, intermediate 18432, vocabulary 32000 for both the draft and the embedding (the
target's 163,840-row embedding would only add a lookup). The CPU is shared: figures move ~20%.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from surgeon.core.points import EMBED, Point, all_points, layer_out  # noqa: E402
from surgeon.draft.behaviour import DraftBehaviour  # noqa: E402
from surgeon.draft.infer import CHAIN_STEPS, Contributions, describe, fused_output, search  # noqa: E402
from surgeon.draft.model import DraftInfo, Eagle3Draft  # noqa: E402

BUDGET_S = 120.0
TRUE = [layer_out(2), layer_out(30), layer_out(58)]
STATED = [EMBED, layer_out(2), layer_out(30)]


EMBED_DIMS, BLOCK_DIMS = 256, 16


def stream_model(L: int, H: int, gap: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic target: a basis ``[K, H]`` (the embedding's 256 directions, then 16 per layer)
    and each point's standard deviation per direction ``[P, K]``: a direction is live from the
    layer that writes it on, each layer's update ``gap`` times the stream's norm."""
    K = EMBED_DIMS + L * BLOCK_DIMS
    basis = torch.randn(K, H, generator=torch.Generator().manual_seed(seed)) / H ** 0.5
    std = torch.zeros(L + 2, K)
    std[0, :EMBED_DIMS] = 1.0
    energy = float(EMBED_DIMS)
    for k in range(L):
        std[k + 1] = std[k]
        scale = gap * (energy / BLOCK_DIMS) ** 0.5
        std[k + 1, EMBED_DIMS + k * BLOCK_DIMS:EMBED_DIMS + (k + 1) * BLOCK_DIMS] = scale
        energy += BLOCK_DIMS * scale ** 2
    std[L + 1] = std[L]  # final_norm: the last layer's output, RMS-normed per token below
    return basis, std


def streams(basis: torch.Tensor, std: torch.Tensor, T: int, seed: int) -> torch.Tensor:
    """``T`` tokens of the random walk at every point ``[P, T, H]``: one coefficient per token and
    direction, shared by every point where that direction is live (a residual stream)."""
    coeff = torch.randn(T, basis.shape[0], generator=torch.Generator().manual_seed(seed))
    out = torch.stack([(coeff * std[p]) @ basis for p in range(std.shape[0])])
    out[-1] = out[-1] * torch.rsqrt(out[-1].square().mean(-1, keepdim=True) + 1e-6)
    return out


def trained_fc(basis: torch.Tensor, std: torch.Tensor, points: list[Point], H: int) -> torch.Tensor:
    """A random initialisation plus, per slot, an update whose rows are distributed as the slot's
    training states (what many gradient steps add: combinations of the states it was fed), twice
    the initialisation's norm."""
    g = torch.Generator().manual_seed(3)
    index = {p: i for i, p in enumerate(points)}
    w = torch.randn(H, len(TRUE) * H, generator=g) * 0.02
    update = torch.cat([(torch.randn(H, basis.shape[0], generator=g) * std[index[p]]) @ basis for p in TRUE], dim=1)
    w += update * (2 * w.norm() / update.norm())
    return w


def kimi_draft(H: int, vocab: int = 32000) -> Eagle3Draft:
    info = DraftInfo(path="<synthetic>", layout="specforge", kind="eagle3", hidden_size=H, n_slots=3,
                     target_vocab_size=vocab, draft_vocab_size=vocab, stated_ids={})
    cfg = {"hidden_size": H, "num_attention_heads": H // 128, "num_key_value_heads": 8, "head_dim": 128,
           "intermediate_size": int(H * 18432 / 7168), "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "vocab_size": vocab, "target_hidden_size": H}
    with torch.device("meta"):
        model = Eagle3Draft(info, cfg)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        model.d2t.zero_()
        attn = model.midlayer.self_attn  # a buffer computed in __init__, left empty by to_empty
        attn.inv_freq.copy_(1.0 / (10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)))
    return model.eval()


def timed_step(model: Eagle3Draft, fused: torch.Tensor, ids: torch.Tensor) -> float:
    t = time.perf_counter()
    with torch.no_grad():
        model.step(fused, ids)
    return time.perf_counter() - t


def run(args) -> dict:
    L, T, H = args.layers, args.tokens, args.hidden
    t0 = time.perf_counter()
    points = all_points(L)
    basis, std = stream_model(L, H, args.gap)
    weight = trained_fc(basis, std, points, H)
    states = streams(basis, std, T, seed=2)
    setup_s = time.perf_counter() - t0

    t = time.perf_counter()
    found = search(weight, states, points, None, [("stated ids read as SpecForge", STATED)], sketch=args.sketch)
    search_s = time.perf_counter() - t

    result = {"layers": L, "hidden": H, "tokens": T, "points": len(points), "gap": args.gap, "sketch": args.sketch,
              "setup_s": round(setup_s, 2), "search_s": round(search_s, 2),
              "found": describe(points, found.weight_wiring), "true": [str(p) for p in TRUE],
              "correct": describe(points, found.weight_wiring) == [str(p) for p in TRUE],
              "slot_margins": [None if s.margin is None else round(s.margin, 4) for s in found.slots],
              "decides": found.weight_decides, "structured_candidates": len(found.candidates)}
    shifted = [c for c in found.candidates if describe(points, c.wiring) == result["true"]]
    result["true_wiring_among_structured"] = shifted[0].label if shifted else None

    model = kimi_draft(H)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 32000, (T,), generator=g)
    signal = DraftBehaviour(model, [ids], [torch.log_softmax(torch.randn(T, 32000, generator=g), -1)], CHAIN_STEPS)
    lazy = Contributions(weight, states)
    top = sorted(found.candidates, key=lambda c: -c.weight_score)[:args.behaviour]
    t = time.perf_counter()
    for c in top:
        signal.evaluate(fused_output(lazy, c.wiring, None))
    behaviour_s = time.perf_counter() - t
    naive = []
    for c in top[:2] or found.candidates[:2]:
        t = time.perf_counter()
        with torch.no_grad():
            fused = torch.nn.functional.linear(torch.cat([states[i] for i in c.wiring], dim=1), weight)
        signal.evaluate(fused)
        naive.append(time.perf_counter() - t)
    per_candidate = sum(naive) / len(naive)
    P = len(points)
    exhaustive = P * (P - 1) * (P - 2)
    ours = search_s + behaviour_s
    result.update({
        "behaviour_candidates": len(top), "behaviour_steps": CHAIN_STEPS,
        "behaviour_s": round(behaviour_s, 2), "ours_total_s": round(ours, 2),
        "naive_per_candidate_s": round(per_candidate, 3), "naive_candidates": exhaustive,
        "naive_estimated_s": round(per_candidate * exhaustive, 0), "naive_is_estimate": True,
        "speedup": round(per_candidate * exhaustive / ours, 0),
        "budget_s": BUDGET_S, "within_budget": setup_s + ours < BUDGET_S,
    })
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gap", type=float, default=0.2)
    ap.add_argument("--behaviour", type=int, default=2)
    ap.add_argument("--sketch", type=int, default=512)
    r = run(ap.parse_args())
    if ap.parse_args().json:
        print(json.dumps(r, indent=2))
        return
    print(f"infer-wiring, synthetic Kimi shape: {r['layers']} layers, hidden {r['hidden']}, {r['tokens']} tokens, "
          f"{r['points']} points, consecutive points {100 * r['gap']:.0f}% apart")
    print(f"  setup (synthetic states and fc, not part of the search): {r['setup_s']:.1f} s")
    print(f"  found {', '.join(r['found'])} (true {', '.join(r['true'])}): {'right' if r['correct'] else 'WRONG'}, "
          f"slot margins {r['slot_margins']}, {'decides' if r['decides'] else 'does not decide'}")
    print(f"  true wiring among the structured candidates as: {r['true_wiring_among_structured']}")
    print(f"  ours: weight-space search over every point {r['search_s']:.1f} s + behaviour on {r['behaviour_candidates']} "
          f"candidates ({r['behaviour_steps']} chained steps + KL) {r['behaviour_s']:.1f} s = {r['ours_total_s']:.1f} s")
    print(f"  naive (ESTIMATED from {r['naive_per_candidate_s']:.2f} s per full fc + chained draft forward, "
          f"timed on 2 candidates): "
          f"{r['naive_candidates']:,} candidates x that = {r['naive_estimated_s'] / 86400:.1f} days")
    print(f"  ratio naive / ours: {r['speedup']:,.0f}x; whole run within {r['budget_s']:.0f} s: {r['within_budget']}")


if __name__ == "__main__":
    main()
