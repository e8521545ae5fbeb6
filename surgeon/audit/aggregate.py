"""The driver's side of an audit: results folded in file order into bounded aggregates.

Results arrive in sorted path order whatever finished first (local processes and Ray tasks
alike), so the cross-file stale check, which names the *earlier* file as the source, gives the
same answer on every run. Memory: per slot a few running sums and a histogram; per flagged file
its findings (up to :data:`MAX_LISTED` files listed); and the cross-file index of sampled rows
(``KEEP`` per slot, capped at :data:`MAX_INDEX` entries, past which new rows are not indexed and
the report says from which file on the stale check stopped).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

MAX_INDEX = 2_000_000
MAX_LISTED = 1000


@dataclass
class SlotAggregate:
    name: str
    declared: str | None
    files: int = 0
    norm_n: int = 0
    norm_mean_sum: float = 0.0
    norm_min: float = math.inf
    norm_max: float = -math.inf
    stat_n: int = 0
    stat_mean: float = 0.0
    stat_m2: float = 0.0
    identity: Counter = field(default_factory=Counter)  # nearest point (or verdict) -> files
    verdicts: Counter = field(default_factory=Counter)
    exact: Counter = field(default_factory=Counter)

    def add(self, s: dict[str, Any]) -> None:
        self.files += 1
        if s.get("norm_mean") is not None:
            self.norm_n += 1
            self.norm_mean_sum += s["norm_mean"]
            self.norm_min = min(self.norm_min, s["norm_min"])
            self.norm_max = max(self.norm_max, s["norm_max"])
        x = s.get("log_norm_median")
        if x is not None:  # Welford: the mean and spread of the identity statistic over files
            self.stat_n += 1
            d = x - self.stat_mean
            self.stat_mean += d / self.stat_n
            self.stat_m2 += d * (x - self.stat_mean)
        ident = s.get("identity") or {}
        if ident:
            self.identity[ident.get("nearest") or ident.get("verdict")] += 1
            self.verdicts[ident.get("verdict")] += 1

    def to_json(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        n = self.stat_n
        return {"name": self.name, "declared": self.declared, "files": self.files,
                "norm_mean": num(self.norm_mean_sum / self.norm_n) if self.norm_n else None,
                "norm_min": num(self.norm_min), "norm_max": num(self.norm_max),
                "log_norm_median_mean": self.stat_mean if n else None,
                "log_norm_median_std": math.sqrt(self.stat_m2 / (n - 1)) if n > 1 else None,
                "identity": dict(sorted(self.identity.items(), key=lambda kv: -kv[1])),
                "verdicts": dict(self.verdicts), "exact": dict(self.exact)}


class Aggregate:
    def __init__(self) -> None:
        self.files = 0
        self.bytes = 0
        self.flagged = 0
        self.listed: list[dict[str, Any]] = []
        self.kinds: Counter = Counter()
        self.slots: dict[str, SlotAggregate] = {}
        self.layouts: Counter = Counter()
        self.exact_files = 0
        self._index: dict[int, tuple[int, int, str, int]] = {}  # row hash -> (context, file#, path, slot)
        self.index_full_at: str | None = None

    def stale_check(self, r: dict[str, Any]) -> None:
        """Add ``stale`` findings to ``r`` for sampled rows an earlier file holds on other tokens,
        and index its own sampled rows."""
        names = [s["name"] for s in r["slots"]]
        seen: dict[int, tuple[str, str]] = {}
        for slot, h, ctx, _tok in r.get("hashes", ()):
            hit = self._index.get(h)
            if hit is not None and hit[0] != ctx and hit[2] != r["path"] and slot not in seen:
                seen[slot] = (hit[2], names[hit[3]] if hit[3] < len(names) else str(hit[3]))
            elif hit is None:
                if len(self._index) < MAX_INDEX:
                    self._index[h] = (ctx, self.files, r["path"], slot)
                elif self.index_full_at is None:
                    self.index_full_at = r["path"]
        for slot, (src, src_slot) in sorted(seen.items()):
            name = names[slot] if slot < len(names) else str(slot)
            r["findings"].append({"kind": "stale", "slot": name,
                                  "detail": f"rows identical (on the hashed columns) to rows of {src} "
                                            f"(slot {src_slot}) on other tokens: "
                                            "a stale buffer or a copy of another sample"})

    def add(self, r: dict[str, Any]) -> None:
        self.files += 1
        self.bytes += r.get("size", 0)
        self.layouts[r.get("layout") or "unreadable"] += 1
        for s in r["slots"]:
            key = s["name"]
            if key not in self.slots:
                self.slots[key] = SlotAggregate(key, s.get("declared"))
            self.slots[key].add(s)
        if r.get("exact") is not None:
            self.exact_files += 1
            for s in r["exact"]:
                if s["name"] in self.slots:
                    self.slots[s["name"]].exact[s["matched"] or s["verdict"]] += 1
        if r["findings"]:
            self.flagged += 1
            self.kinds.update({f["kind"] for f in r["findings"]})
            if len(self.listed) < MAX_LISTED:
                self.listed.append({"path": r["path"], "findings": r["findings"]})
