"""Exact identification in an audit: which files get it, and running it.

The identity statistics (:mod:`surgeon.audit.profile`) cannot tell a slot's declared point from a
near one on a target whose points do not separate (adjacent layers a few percent apart): the
verdict is ``unresolved``, and a label shifted by a slot or a slot off by one layer is invisible
to them. Exact identification runs the target on a file's own tokens and names each slot's point
(:func:`surgeon.verify.harness.match`, what ``surgeon verify`` runs). The driver runs it after the
statistics pass (one copy of the target, whatever the workers), on

1. the files the statistics leave *undecided* (:func:`open_slots`: a declared slot ``unresolved``,
   or ``not_run`` without a finding of its own), evenly spaced over them, as many as the budget
   allows (the *escalation*);
2. then evenly spaced files of the rest: a spot check.

The budget: ``--exact N`` is N files in all, the undecided first (0: none). By default (``auto``)
every undecided file when the target is *small*: its parameter count times those files' tokens at
most :data:`PARAM_TOKENS`, else as many evenly spaced ones as fit that product; and :data:`SPOT`
others. A file costs about its parameter-tokens: a forward pass is ~2 FLOPs per parameter and
token (the per-point comparisons add ~points x hidden per token, small beside a real target's
parameters). Measured on 2 shared CPU cores, one torch thread (:data:`ONE_THREAD_BELOW`): Llamas of
7M and 14M parameters on 512 and 1024 tokens at ~1e10 parameter-tokens a second (0.26-1.4 s a
file), so the default budget is about a minute of CPU where the parameters dominate; the 0.87M
parameters of ``benchmarks/audit_undecided.py``'s target, 0.075 s a file (a file's fixed costs, the
model's load among them, dominate: ~1e9 a second), 22-31 s for 300 files.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgeon.core.shapes import Reads, reads

PARAM_TOKENS = 5e11  # the automatic budget: the target's parameters x the escalated files' tokens
# a target this small runs on one torch thread: its ops take a few ms, and two threads stall at each
# op's barrier when a neighbour is busy (measured on 2 cores, a Llama of 14M parameters on 1024 tokens:
# 1.0-1.4 s a file on one thread, 3.1 s on two)
ONE_THREAD_BELOW = 100_000_000
SPOT = 4  # files identified exactly as a spot check by default, beside the escalation
OPEN = ("unresolved", "not_run")  # identity verdicts that decide nothing
BUDGET_RULE = (f"auto: every undecided file when the target's parameter count x those files' tokens is at most "
               f"{PARAM_TOKENS:.0e} (a small target), else as many evenly spaced ones as fit it; and {SPOT} "
               "evenly spaced others as a spot check")


def open_slots(r: dict[str, Any]) -> list[str]:
    """The slots of a file's result whose identity the statistics leave undecided: a declared slot
    whose verdict is ``unresolved``, or ``not_run`` without a finding of its own (a slot of no
    finite rows is a finding already: decided, as bad)."""
    own = {f.get("slot") for f in r.get("findings", ())}
    return [s["name"] for s in r.get("slots", ())
            if s.get("declared") is not None and (s.get("identity") or {}).get("verdict") in OPEN
            and not (s["identity"]["verdict"] == "not_run" and s["name"] in own)]


def exact_picks(n: int, k: int) -> set[int]:
    """``k`` evenly spaced indices of ``n`` (all of them where there are no more)."""
    m = min(k, n)
    if m <= 0:
        return set()
    return {min(n - 1, (i * n) // m + (n // m) // 2) for i in range(m)}


def _spread(items: list, k: int) -> list:
    return [items[j] for j in sorted(exact_picks(len(items), k))]


def parameters(model_dir: str | Path) -> int | None:
    """The parameter count of the HF model folder, from its safetensors headers (no tensor read);
    None where it holds no safetensors file whose header reads."""
    from surgeon.core.errors import BadInput
    from surgeon.core.safefile import open_regular

    total, seen = 0, False
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:  # never blocking on a FIFO named *.safetensors, never reading a device
            with os.fdopen(open_regular(f, what="the safetensors file"), "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n)) if 0 < n < (100 << 20) else {}
        except (OSError, ValueError, BadInput):
            continue
        for name, meta in header.items():
            if name != "__metadata__" and isinstance(meta, dict) and isinstance(meta.get("shape"), list):
                count = 1
                for d in meta["shape"]:
                    count *= int(d)
                total, seen = total + count, True
    return total if seen else None


@dataclass
class ExactRun:
    """What exact identification did in one audit (reported as an :class:`ExactReport`)."""

    model: str | None  # the HF model folder; None: not possible (no --reference hf:MODEL)
    budget: int | None  # --exact N; None: auto
    params: int | None = None
    undecided: int = 0  # files the statistics left undecided (the escalation's candidates)
    escalated: list[int] = field(default_factory=list)  # file indices, of those
    spot: list[int] = field(default_factory=list)
    small: bool | None = None  # auto: whether every undecided file fit the budget
    param_tokens: float = 0.0  # of the escalated files
    ran: int = 0  # files identified in this run (the rest came from the resume state)
    seconds: float = 0.0

    @property
    def rule(self) -> str:
        if self.model is None:
            return "none: exact identification needs --reference hf:MODEL"
        if self.budget is not None:
            return (f"--exact {self.budget}: at most {self.budget} files, the undecided first" if self.budget
                    else "--exact 0: none")
        return BUDGET_RULE

    def describe(self, files: int, found: int) -> str:
        """The note: how many files were identified exactly, by which rule, and what it found."""
        if self.model is None:
            return "exact identification not run: it needs --reference hf:MODEL to run the target on each file's own tokens"
        if self.budget == 0:
            return (f"exact identification not run (--exact 0), though the statistics left {self.undecided} file(s) "
                    "undecided" if self.undecided else "exact identification not run (--exact 0)")
        size = "" if self.params is None else f" ({self.params:,} parameters)"
        head = (f"exact identification ({self.rule}): {files} file(s) against {self.model}{size} run on their own "
                f"tokens: {len(self.escalated)} of the {self.undecided} the statistics left undecided"
                f", {len(self.spot)} evenly spaced others")
        if self.budget is None and self.undecided:
            head += (f"; the escalation's {self.param_tokens:.2g} parameter-tokens "
                     + ("fit the budget: a small target" if self.small else f"are what {PARAM_TOKENS:.0e} allows"))
        return head + f"; {found} with a slot not its declared point; {self.seconds:.1f} s"


@reads("run", "model budget rule params seconds")
@dataclass(frozen=True)
class ExactReport:
    """Exact identification as an audit reports it (``exact`` in the JSON:
    :class:`surgeon.audit.output.AuditExact`): the run, and the files identified exactly in all
    (this run's and the resume state's) and how many of those have a slot not its declared point."""

    run: ExactRun
    files: int
    found: int

    undecided_files = Reads("run.undecided")
    escalated = property(lambda self: len(self.run.escalated))  # how many of the undecided files
    spot_checked = property(lambda self: len(self.run.spot))  # how many others, evenly spaced


def select(run: ExactRun, n: int, undecided: list[tuple[int, int]]) -> None:
    """Fill ``run.escalated`` and ``run.spot`` for a set of ``n`` files, ``undecided`` its undecided
    files' (index, tokens) in file order."""
    run.undecided = len(undecided)
    if run.model is None or run.budget == 0:
        return
    run.params = parameters(run.model)
    if run.budget is not None:
        run.escalated = [i for i, _ in _spread(undecided, run.budget)]
        spot = run.budget - len(run.escalated)
    else:
        run.escalated, run.small = _fit(undecided, run.params)
        spot = SPOT
    chosen = set(run.escalated)
    run.param_tokens = float(run.params or 0) * sum(t for i, t in undecided if i in chosen)
    rest = [i for i in range(n) if i not in chosen]
    run.spot = _spread(rest, spot)


def _fit(undecided: list[tuple[int, int]], params: int | None) -> tuple[list[int], bool]:
    """The undecided files the automatic budget covers (all of them for a small target, else as
    many evenly spaced ones as fit it) and whether that is all of them. A target of unknown size
    (no safetensors header) is taken as small."""
    if not undecided:
        return [], True
    total = sum(t for _, t in undecided)
    if params is None or params * total <= PARAM_TOKENS:
        return [i for i, _ in undecided], True
    k = int(PARAM_TOKENS // (params * max(1.0, total / len(undecided))))
    while k > 0:
        pick = _spread(undecided, k)
        if params * sum(t for _, t in pick) <= PARAM_TOKENS:
            return [i for i, _ in pick], False
        k -= 1
    return [], False


def identify_exactly(run: ExactRun, ctx, state, agg, paths: list[str],
                     progress: Callable[[int, int], None] = lambda done, total: None) -> None:
    """Exact identification of the selected files, in file order: each result read back from the
    state (recorded as it finished), identified on its own tokens, folded into the aggregate and
    recorded again (a resumed audit takes the later record). A file whose result already holds it
    (from the resume state) is not run again; one not recorded (an error, a failed read) or
    changed since is skipped: it is flagged or audited again already. ``progress(done, total)``
    after each file."""
    import torch

    from surgeon.audit.worker import exact_identify, file_key

    chosen = sorted({*run.escalated, *run.spot})
    if not chosen:
        return
    started, threads = time.perf_counter(), torch.get_num_threads()
    if run.params is not None and run.params < ONE_THREAD_BELOW:
        torch.set_num_threads(1)
    try:
        for k, i in enumerate(chosen):
            progress(k, len(chosen))
            try:
                r = state.done(file_key(paths[i]))
            except OSError:
                continue
            if r is None or r.get("exact") is not None:
                continue
            before = len(r["findings"])
            exact_identify(ctx, r)
            run.ran += 1
            agg.add_exact(i, r, before)
            state.record(r)
        progress(len(chosen), len(chosen))
    finally:
        torch.set_num_threads(threads)
        run.seconds = time.perf_counter() - started
