"""The identity pass: a per-point profile of the target that does not depend on the tokens, and
each slot of each file matched to the nearest point's profile.

The statistic is the median over tokens of ``log ||h_t||`` (the per-token L2 norm): the residual
stream's norm grows with depth and the final norm resets it to ~``sqrt(H) * |w|``, whatever the
text (the Kimi-K2.5 mislabelling was found by hand exactly so, from per-token norms). A median
ignores the few huge "attention sink" tokens. A point's profile is that statistic's centre and
its spread from sample to sample, measured on the reference prompts (files of the set itself
when the reference is a model): the median of the prompts' statistics and their standard deviation;
with fewer than :data:`MIN_PROMPTS` prompts (a reference file holds one), the standard deviation of
the statistic over chunks of :data:`CHUNK` tokens, which is wider than over whole samples
(conservative: fewer false alarms, less power).

A slot *fits* a point when its statistic lies within ``tol = max(MIN_TOL, K * spread)`` of the
point's centre. Verdicts:

* ``ok``: it fits its declared point and that point is the nearest;
* ``mismatch``: it does not fit its declared point but fits another (``nearest`` names it);
* ``no_match``: it fits no point (a foreign state, a scaled or broken buffer);
* ``unresolved``: it fits its declared point but another point is nearer: the profile cannot
  tell these points apart (adjacent deep layers often differ in norm by less than the spread);
  not a failure, and said so (the exact identification on a sample of files is what decides);
* ``not_run``: no finite rows, no declared point, or no profile.

Only ``mismatch`` and ``no_match`` fail an audit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from surgeon.core.errors import BadInput
from surgeon.core.points import Point

K = 8.0
MIN_PROMPTS = 6  # fewer reference prompts: the spread is measured over CHUNK-token chunks of them
CHUNK = 32
K_CHUNKS = 10.0  # chunks of one prompt vary less than whole samples do at some depths: a wider band
MIN_TOL = 0.03  # log units: 3% in norm


@dataclass(frozen=True)
class PointProfile:
    point: str
    centre: float  # median over tokens of log per-token norm
    spread: float  # std of that statistic over prompts (or CHUNK-token chunks of too few prompts)
    k: float = K  # tolerance in spreads

    @property
    def tol(self) -> float:
        return max(MIN_TOL, self.k * self.spread)


@dataclass(frozen=True)
class Profile:
    points: tuple[PointProfile, ...]  # forward-pass order
    source: str
    prompts: int
    tokens: int

    def to_json(self) -> dict:
        return {"source": self.source, "prompts": self.prompts, "tokens": self.tokens,
                "points": [{"point": p.point, "centre": p.centre, "spread": p.spread, "tol": p.tol}
                           for p in self.points]}


def _log_norms(norms):
    import torch

    n = norms.double().reshape(-1)
    return n[torch.isfinite(n) & (n > 0)].log()


def profile_from_norms(prompts: list[dict[Point, object]], num_layers: int, source: str) -> Profile:
    """A profile from per-token norms ``{point: [T]}`` of one or more prompts (deltas ignored):
    per point, the median of the prompts' statistics and their spread (one prompt: the spread of
    its halves)."""
    import torch

    if not prompts:
        raise BadInput("no reference states to build the identity profile from")
    points = [p for p in sorted(prompts[0], key=lambda p: p.depth(num_layers)) if p.kind != "layer_delta"]
    out, tokens = [], 0
    for p in points:
        logs = [_log_norms(norms[p]) for norms in prompts]
        if not sum(ln.numel() for ln in logs):
            raise BadInput(f"the reference's {p} holds no finite nonzero rows: no profile")
        if len(logs) < MIN_PROMPTS:  # too few prompts to measure a spread: chunks of one prompt, conservatively
            stats = torch.tensor([float(ln[a:a + CHUNK].median()) for ln in logs for a in range(0, ln.numel(), CHUNK)
                                  if ln[a:a + CHUNK].numel() >= CHUNK // 2], dtype=torch.float64)
            centre = float(torch.cat(logs).median())
            k = K_CHUNKS
        else:
            k = K
            stats = torch.tensor([float(ln.median()) for ln in logs if ln.numel()], dtype=torch.float64)
            centre = float(stats.median())
        spread = float(stats.std()) if stats.numel() > 1 else 0.0
        out.append(PointProfile(str(p), centre, spread if math.isfinite(spread) else 0.0, k))
        tokens = sum(int(ln.numel()) for ln in logs)
    return Profile(tuple(out), source, len(prompts), tokens)


def profile_from_states(prompts: list[dict[Point, Any]], num_layers: int, source: str) -> Profile:
    """A profile from reference states ``{point: [T, H]}`` of one or more prompts."""
    import torch

    return profile_from_norms([{p: torch.linalg.vector_norm(x.float(), dim=1) for p, x in states.items()}
                               for states in prompts], num_layers, source)


def match_slot(profile: Profile | None, declared: str | None, stat: float | None) -> dict:
    """The identity of one slot against the profile: nearest point, verdict, distance (in tols)."""
    if profile is None or declared is None or stat is None or not math.isfinite(stat):
        return {"nearest": None, "verdict": "not_run", "distance": None}
    dist = {p.point: abs(stat - p.centre) / p.tol for p in profile.points}
    nearest = min(profile.points, key=lambda p: abs(stat - p.centre)).point  # in norm, not in tolerances
    if declared not in dist:
        return {"nearest": nearest, "verdict": "not_run", "distance": None}
    if dist[declared] <= 1.0:
        verdict = "ok" if nearest == declared or dist[nearest] == dist[declared] else "unresolved"
    else:
        verdict = "mismatch" if dist[nearest] <= 1.0 else "no_match"
    return {"nearest": nearest if dist[nearest] <= 1.0 else None, "verdict": verdict, "distance": dist[declared]}
