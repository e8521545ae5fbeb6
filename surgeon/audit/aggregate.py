"""The driver's side of an audit: results folded in file order into bounded aggregates.

Results arrive in sorted path order whatever finished first (local processes and Ray tasks
alike), so the cross-file stale check, which names the *earlier* file as the source, gives the
same answer on every run. Memory: per slot a few running sums and a histogram; per flagged file
its findings (up to :data:`MAX_LISTED` files listed); and the cross-file index of sampled rows
(``KEEP`` per slot, capped at :data:`MAX_INDEX` entries, past which new rows are not indexed and
the report says from which file on the stale check stopped), 24 bytes an entry in sorted numpy
arrays (:class:`RowIndex`) and a list of the files' paths: the 1.6M rows of a 100k-sample set of
4 slots peak at 59 MB, where a dict of tuples took 274 MB (tracemalloc, ``tests/audit/test_aggregate.py``'s
rows; 44 us a file against 15 us, beside an audit's milliseconds a file).

Per slot, the identity counts: the statistics' verdicts, exact identification's, and the files
neither decided (``undecided``: most of a slot's files so is an undecided audit, exit 4). A file
identified exactly after the statistics pass (:mod:`surgeon.audit.exact`) is folded in again with
:meth:`Aggregate.add_exact`: the slots it decided, and its new findings in file order. A slot's
JSON (``slots`` in the audit's) is :class:`surgeon.audit.output.AuditSlot`, read from its attributes.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from surgeon.audit.exact import open_slots

MAX_INDEX = 2_000_000
MAX_LISTED = 1000
VERDICTS = ("ok", "mismatch", "no_match", "unresolved", "not_run")  # the statistics' (surgeon.audit.profile)
EXACT_VERDICTS = ("ok", "mismatch", "no_match", "undecided", "unlabelled")  # exact identification's
OPEN_EXACT = ("undecided",)  # exact verdicts that leave a slot undecided


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
    # the statistics' verdicts -> files, every one counted (0 included), in VERDICTS' order
    verdicts: Counter = field(default_factory=lambda: Counter(dict.fromkeys(VERDICTS, 0)))
    exact: Counter = field(default_factory=Counter)  # matched point (or verdict) -> files identified exactly
    exact_verdicts: Counter = field(default_factory=lambda: Counter(dict.fromkeys(EXACT_VERDICTS, 0)))
    open: int = 0  # files whose identity neither the statistics nor exact identification decided

    @property
    def undecided(self) -> int:
        """The files whose identity neither the statistics nor exact identification decided."""
        return self.open

    @property
    def mostly_undecided(self) -> bool:
        """Whether the identity of most of the slot's files is undecided."""
        return self.open > 0 and 2 * self.open > self.files

    @property
    def norm_mean(self) -> float | None:
        """The mean over files of the slot's mean per-token norm (None: no file had one)."""
        return self.norm_mean_sum / self.norm_n if self.norm_n else None

    @property
    def log_norm_median_mean(self) -> float | None:
        """The identity statistic's mean over files (None: no file had it)."""
        return self.stat_mean if self.stat_n else None

    @property
    def log_norm_median_std(self) -> float | None:
        """The identity statistic's spread over files (None: fewer than two had it)."""
        return math.sqrt(self.stat_m2 / (self.stat_n - 1)) if self.stat_n > 1 else None

    def add(self, s: dict[str, Any], exact: dict[str, Any] | None = None, is_open: bool = False) -> None:
        """Fold one file's slot: its values, its identity by the statistics, its exact
        identification if it had one (``exact``), and whether the statistics left it undecided
        (``is_open``: :func:`surgeon.audit.exact.open_slots`)."""
        self.files += 1
        if is_open and (exact is None or exact["verdict"] in OPEN_EXACT):
            self.open += 1
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


class RowIndex:
    """Row hash -> (context, file number, slot) of the first file that sampled the row: sorted
    int64/int64/int32/int32 arrays, and the newest entries in a dict merged into them every
    :data:`BUFFER` entries (a file's lookups: one binary search of the arrays for all its rows)."""

    BUFFER = 1 << 15  # ~6 MB of dict

    def __init__(self) -> None:
        import numpy as np

        self._hash: Any = np.empty(0, dtype=np.int64)
        self._ctx: Any = np.empty(0, dtype=np.int64)
        self._file: Any = np.empty(0, dtype=np.int32)
        self._slot: Any = np.empty(0, dtype=np.int32)
        self._new: dict[int, tuple[int, int, int]] = {}

    def __len__(self) -> int:
        return self._hash.size + len(self._new)

    def lookup(self, hashes: list[int]) -> list[tuple[int, int, int] | None]:
        """The entry of each of ``hashes`` (None where it has none)."""
        import numpy as np

        out: list[tuple[int, int, int] | None] = [self._new.get(h) for h in hashes]
        if self._hash.size and hashes:
            q = np.array(hashes, dtype=np.int64)
            at = np.minimum(np.searchsorted(self._hash, q), self._hash.size - 1)
            for i in np.flatnonzero(self._hash[at] == q).tolist():
                j = int(at[i])
                out[i] = (int(self._ctx[j]), int(self._file[j]), int(self._slot[j]))
        return out

    def add(self, h: int, ctx: int, file: int, slot: int) -> None:
        """Index ``h`` (not yet indexed: the caller looked it up)."""
        self._new[h] = (ctx, file, slot)
        if len(self._new) >= self.BUFFER:
            self._merge()

    def _merge(self) -> None:
        """The dict's entries into the arrays: sorted, and inserted where they go (one copy of the arrays)."""
        import numpy as np

        n = len(self._new)
        hs = np.fromiter(self._new.keys(), dtype=np.int64, count=n)
        rest = np.fromiter((x for v in self._new.values() for x in v), dtype=np.int64, count=3 * n).reshape(n, 3)
        self._new = {}
        order = np.argsort(hs)
        hs, rest = hs[order], rest[order]
        at = np.searchsorted(self._hash, hs)
        self._hash = np.insert(self._hash, at, hs)
        self._ctx = np.insert(self._ctx, at, rest[:, 0])
        self._file = np.insert(self._file, at, rest[:, 1].astype(np.int32))
        self._slot = np.insert(self._slot, at, rest[:, 2].astype(np.int32))


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
        self.exact_found = 0  # files identified exactly with a slot not its declared point
        self._listed_at: list[int] = []  # the file number of each listed file
        self._index = RowIndex()
        self._paths: list[str] = []  # by file number: the files the index names
        self.index_full_at: str | None = None

    def stale_check(self, r: dict[str, Any]) -> None:
        """Add ``stale`` findings to ``r`` for sampled rows an earlier file holds on other tokens,
        and index its own sampled rows."""
        names = [s["name"] for s in r["slots"]]
        seen: dict[int, tuple[str, str]] = {}
        rows = list(r.get("hashes", ()))
        me = len(self._paths)  # this file's number
        mine: dict[int, tuple[int, int, int]] = {}  # the rows it indexed (a row may be twice in a file)
        for (slot, h, ctx, _tok), hit in zip(rows, self._index.lookup([row[1] for row in rows])):
            hit = mine.get(h) if hit is None else hit
            src = r["path"] if hit is None or hit[1] == me else self._paths[hit[1]]
            if hit is not None and hit[0] != ctx and src != r["path"] and slot not in seen:
                seen[slot] = (src, names[hit[2]] if hit[2] < len(names) else str(hit[2]))
            elif hit is None:
                if len(self._index) < MAX_INDEX:
                    self._index.add(h, ctx, me, slot)
                    mine[h] = (ctx, me, slot)
                elif self.index_full_at is None:
                    self.index_full_at = r["path"]
        if mine:
            self._paths.append(r["path"])
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
        exact = {s["name"]: s for s in r.get("exact") or ()}
        is_open = set(open_slots(r))
        for s in r["slots"]:
            key = s["name"]
            if key not in self.slots:
                self.slots[key] = SlotAggregate(key, s.get("declared"))
            self.slots[key].add(s, exact.get(key), key in is_open)
        if r.get("exact") is not None:
            self._fold_exact(r)
        if r["findings"]:
            self.flagged += 1
            self.kinds.update({f["kind"] for f in r["findings"]})
            if len(self.listed) < MAX_LISTED:
                self.listed.append({"path": r["path"], "findings": r["findings"]})
                self._listed_at.append(self.files - 1)

    def _fold_exact(self, r: dict[str, Any]) -> None:
        self.exact_files += 1
        for s in r["exact"]:
            if s["name"] in self.slots:
                self.slots[s["name"]].exact[s["matched"] or s["verdict"]] += 1
                self.slots[s["name"]].exact_verdicts[s["verdict"]] += 1
        if any(f["kind"] == "exact" for f in r["findings"]):
            self.exact_found += 1

    def add_exact(self, number: int, r: dict[str, Any], before: int) -> None:
        """Fold the exact identification of file ``number`` (its result ``r``, added before, now
        with ``r["exact"]`` and the findings past the first ``before`` that it added): the slots it
        decided, and the file flagged, listed in file order, where it found something."""
        import bisect

        old, new = r["findings"][:before], r["findings"][before:]
        if r.get("exact") is not None:
            decided = {s["name"] for s in r["exact"] if s["verdict"] not in OPEN_EXACT}
            for name in set(open_slots({**r, "findings": old})) & decided:
                if name in self.slots:
                    self.slots[name].open -= 1
            self._fold_exact(r)
        if not new:
            return
        self.kinds.update({f["kind"] for f in new} - {f["kind"] for f in old})
        at = bisect.bisect_left(self._listed_at, number)
        if at < len(self._listed_at) and self._listed_at[at] == number:
            self.listed[at] = {"path": r["path"], "findings": r["findings"]}
            return
        if not old:
            self.flagged += 1
        if at < MAX_LISTED:
            self.listed.insert(at, {"path": r["path"], "findings": r["findings"]})
            self._listed_at.insert(at, number)
            del self.listed[MAX_LISTED:], self._listed_at[MAX_LISTED:]
