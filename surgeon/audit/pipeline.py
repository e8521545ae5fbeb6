"""An audit of a whole training set: discover, audit each file (in this process, in local worker
processes, or as Ray tasks), fold the results in file order, resume where a run stopped; then
identify exactly the files the statistics left undecided, within the budget
(:mod:`surgeon.audit.exact`), and give the verdict: clean, flagged, or undecided
(:mod:`surgeon.audit.summary`).

Memory is bounded by the number of files in flight (``4 x workers`` batches), not the number of
files: each worker holds one file's tensors at a time, the driver holds aggregates
(:mod:`surgeon.audit.aggregate`), and the state file (:mod:`surgeon.audit.state`) holds every
finished file's result on disk.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgeon.audit import summary
from surgeon.audit.aggregate import Aggregate, SlotAggregate
from surgeon.audit.exact import PARAM_TOKENS, ExactReport, ExactRun, identify_exactly, open_slots, select
from surgeon.audit.heap import settled, trim
from surgeon.audit.profile import Profile
from surgeon.audit.state import State
from surgeon.audit.structure import STATE_NAME, discover
from surgeon.audit.worker import (
    BATCH,
    ERROR,
    Context,
    batches,
    file_key,
    init_worker,
    run_batch,
    run_batch_here,
)
from surgeon.core.errors import UNDECIDED, BadInput
from surgeon.core.shapes import Reads

FAILING = ("identity", "exact")  # finding kinds that say a slot is not what the spec declares


@dataclass
class AuditReport:
    """An audit's result. Its JSON (``surgeon audit --json``) is read from its attributes by the
    names of the output's keys (:class:`surgeon.commands.outputs.audit.AuditOutput`); the properties
    below give those the attributes do not hold as such."""

    root: str
    spec: str
    files: int
    resumed: int
    seconds: float
    bytes: int
    workers: int
    backend: str
    agg: Aggregate
    profile: Profile | None
    exact_model: str | None
    structure_only: bool
    notes: list[str] = field(default_factory=list)
    report_path: str | None = None
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds per process (local runs), not in the JSON
    exact_run: ExactRun | None = None

    @property
    def undecided(self) -> list[str]:
        """The slots whose identity is undecided for most of their files (a structure pass judges
        no identity: none)."""
        return [] if self.structure_only else [s.name for s in self.agg.slots.values() if s.mostly_undecided]

    @property
    def ok(self) -> bool:
        """No finding, and every slot's identity decided for most of its files."""
        return self.agg.flagged == 0 and not self.undecided

    @property
    def exit_code(self) -> int:
        """0 clean, 3 findings, 4 (:data:`~surgeon.core.errors.UNDECIDED`) no finding but a slot
        whose identity is undecided for most files, 1 where a file hit an error no check foresaw
        (an internal error: the rest of the set audited and reported all the same)."""
        return 1 if self.agg.kinds.get(ERROR) else 3 if self.agg.flagged else UNDECIDED if self.undecided else 0

    verdict = property(summary.verdict)  # ok, flagged, undecided or error
    headline = property(summary.headline)  # the report's first line

    @property
    def cannot_see(self) -> list[str]:
        """Where a slot is undecided, the faults only the identity pass finds; else none."""
        return list(summary.CANNOT_SEE) if self.undecided else []

    flagged = Reads("agg.flagged")

    @property
    def findings(self) -> dict[str, int]:
        """Finding kind -> files with it, by kind."""
        return dict(sorted(self.agg.kinds.items()))

    @property
    def layouts(self) -> dict[str, int]:
        return dict(self.agg.layouts)

    @property
    def files_per_s(self) -> float | None:
        """Files audited (not resumed) a second, to 0.1."""
        rate = (self.files - self.resumed) / self.seconds if self.seconds > 0 else None
        return round(rate, 1) if rate is not None and math.isfinite(rate) else None

    @property
    def mb_per_s(self) -> float | None:
        """MB read a second, to 0.1."""
        return round(self.bytes / self.seconds / 1e6, 1) if self.seconds > 0 else None

    @property
    def slots(self) -> list[SlotAggregate]:
        return list(self.agg.slots.values())

    @property
    def exact(self) -> ExactReport:
        """Exact identification: this run's, and the files identified exactly in all."""
        return ExactReport(self.exact_run or ExactRun(self.exact_model, None), self.agg.exact_files, self.agg.exact_found)

    @property
    def outliers(self) -> list[dict[str, Any]]:
        """The flagged files (their path and findings) in path order, the first :data:`~surgeon.audit.aggregate.MAX_LISTED`."""
        return self.agg.listed

    @property
    def outliers_listed(self) -> int:
        return len(self.agg.listed)

    @property
    def report(self) -> str | None:
        """The HTML report written, if any."""
        return self.report_path


LOCAL_BATCH = 4  # files per task in a local pool: each task costs the driver ~1 ms (measured); fine grains balance the end


def _local(ctx: Context, todo: list[str], workers: int, cpu: dict[str, float]) -> Iterator[dict[str, Any]]:
    """Results in ``todo`` order: inline for one worker, else a pool of ``workers`` persistent
    processes (forked: no start-up import; the context handed over once) with a bounded window of
    batches in flight. ``cpu``: CPU seconds per process (``driver``, ``worker PID``)."""
    import torch

    start = time.process_time()
    if workers <= 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # many small ops: one thread each (a worker = a core); threads stall at
        try:  # barriers when a neighbour is busy (~10x slower on a loaded 2-core machine, measured)
            with settled():
                for batch in batches(todo, BATCH):
                    yield from run_batch(ctx, batch)
        finally:
            torch.set_num_threads(threads)
            cpu["driver"] = time.process_time() - start
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # fork on Linux only: macOS made spawn the default because forking after system frameworks (and
    # torch's thread pools) start is unsafe there
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method), initializer=init_worker,
                             initargs=(ctx, os.getpid())) as pool:  # each worker dies with this driver
        window: deque = deque()

        def take() -> list[dict[str, Any]]:
            results, pid, used = window.popleft().result()
            cpu[f"worker {pid}"] = used
            return results

        try:
            for batch in batches(todo, LOCAL_BATCH):
                window.append(pool.submit(run_batch_here, batch))
                if len(window) >= 4 * workers:
                    yield from take()
            while window:
                yield from take()
        except BaseException:  # Ctrl-C, an error, a consumer gone: the batches in flight dropped, workers stopped
            _stop_workers(pool)  # first: shutting down forgets the processes
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    cpu["driver"] = time.process_time() - start


def _stop_workers(pool) -> None:
    """Terminate a process pool's workers (which ignore Ctrl-C) rather than wait for their batches:
    a second Ctrl-C would otherwise interrupt that wait and leave them running."""
    stop = getattr(pool, "terminate_workers", None)  # Python 3.14
    if stop is not None:
        stop()
        return
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        proc.terminate()


@dataclass
class Plan:
    root: Path
    spec_path: str
    reference: str | None = None
    # local processes; None: one per usable core (:func:`usable_cores`), but one for a structure pass
    # (headers only: handing a file's few-KB answer to the driver costs more than reading it; measured)
    workers: int | None = None
    ray_address: str | None = None
    resume: bool = False
    structure_only: bool = False
    exact_files: int | None = None  # the exact identification budget in files; None: automatic (surgeon.audit.exact)
    state_path: Path | None = None
    # (profile, exact model folder) as :func:`surgeon.audit.reference.build_profile` gave them for this
    # set and spec: not built again (a benchmark builds it once, before it empties the page cache)
    built: tuple[Profile | None, str | None] | None = None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one: a container or a
    ``taskset`` sees its own share, not the host's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def _executor(plan: Plan, ctx: Context, workers: int,
              cpu: dict[str, float]) -> tuple[Callable[[list[str]], Iterator[dict[str, Any]]], str]:
    if plan.ray_address:
        from surgeon.audit.ray_backend import run_on_ray

        return (lambda todo: run_on_ray(plan.ray_address, ctx, todo, workers)), f"ray:{plan.ray_address}"
    return (lambda todo: _local(ctx, todo, workers, cpu)), "local"


def _workers(plan: Plan, notes: list[str]) -> int:
    """The local worker processes: ``--workers``, at least 1, at most the usable cores (one more
    process per core only adds memory and contention: ``--workers 1000000`` must not fork a million,
    so it runs on the cores with a note); on Ray, ``--workers`` only widens the window of tasks in
    flight, as given."""
    workers = plan.workers if plan.workers is not None else 1 if plan.structure_only else usable_cores()
    if workers < 1:
        raise BadInput(f"--workers {workers}: at least 1")
    if not plan.ray_address and workers > (cores := usable_cores()):
        notes.append(f"--workers {workers}: {cores} worker processes, one per usable core (no more are started)")
        workers = cores
    return workers


def run_audit(plan: Plan, update: Callable[[int, int], None] = lambda d, t: None) -> AuditReport:
    from surgeon.audit.reference import build_profile
    from surgeon.core.spec import load_spec

    if not plan.root.is_dir():
        raise BadInput(f"{plan.root}: {'no such directory' if not plan.root.exists() else 'not a directory'}")
    notes: list[str] = []
    workers = _workers(plan, notes)
    spec = load_spec(plan.spec_path)
    root = plan.root.resolve()
    paths = [str(p) for p in discover(root)]  # one key per file however DIR was typed, wherever from
    if not paths:
        raise BadInput(f"{plan.root}: no .ckpt, .safetensors or .pt files under it")
    if plan.ray_address:
        from surgeon.audit.ray_backend import check_address

        check_address(plan.ray_address)  # before any work, and before the state is opened (and emptied)
    if not plan.structure_only:
        from surgeon.audit.norms import warm

        warm()  # the norm kernel compiled here, before any work (numba missing: exit 2 now); forked workers inherit it
    state_path = plan.state_path or plan.root / STATE_NAME
    if plan.structure_only:
        profile, exact_model = None, None
    else:  # a resumed audit runs the target on the files its state names: the profile recorded
        prefer = _recorded_prompts(state_path, root, paths) if plan.resume else []
        profile, exact_model = plan.built or build_profile(plan.reference, spec, paths, notes, prefer)
    if workers > 1 and not plan.ray_address:
        gc.collect()  # here, before the fork: no worker inherits the driver's garbage, or walks (and so copies) it
        trim()  # the profile's build left freed heap: forking workers would copy its page tables
    ctx = Context(str(Path(plan.spec_path).resolve()), profile, exact_model, plan.structure_only)
    exact = ExactRun(exact_model, plan.exact_files if exact_model else 0)
    state = State(state_path, {"spec_sha256": spec.sha256, "profile": profile.digest() if profile else None,
                               "prompt_files": [os.path.relpath(f, root) for f in profile.files] if profile else [],
                               "exact_model": exact_model, "exact_files": "auto" if exact.budget is None else exact.budget,
                               "exact_budget": PARAM_TOKENS if exact.budget is None else None,
                               "structure_only": plan.structure_only}, plan.resume)
    cpu: dict[str, float] = {}
    run, backend = _executor(plan, ctx, workers, cpu)
    agg, started = Aggregate(), time.perf_counter()
    try:
        resumed, undecided = _stream(plan, ctx, state, run, paths, agg, notes, update)
        # exact identification: the driver alone (one copy of the target), after the statistics told
        # which files they leave undecided
        select(exact, len(paths), undecided)
        n = len(paths)  # the bar goes on past the set's files, one step per file identified exactly
        identify_exactly(exact, ctx, state, agg, paths, lambda k, total: update(n + k, n + total))
    finally:
        state.close()
    _notes(notes, agg, plan, profile, exact)
    return AuditReport(str(plan.root), plan.spec_path, len(paths), resumed, time.perf_counter() - started, agg.bytes,
                       workers, backend, agg, profile, exact_model, plan.structure_only, notes, cpu_s=cpu, exact_run=exact)


def _stream(plan: Plan, ctx: Context, state: State, run: Callable[[list[str]], Iterator[dict[str, Any]]],
            paths: list[str], agg: Aggregate, notes: list[str],
            update: Callable[[int, int], None]) -> tuple[int, list[tuple[int, int]]]:
    """Every file's result folded into ``agg`` in file order, from the state where it is recorded
    and unchanged (``--resume``), else from ``run``; each fresh one recorded. Returns how many came
    from the state, and the (index, tokens) of the files whose identity the statistics left
    undecided (:func:`surgeon.audit.exact.open_slots`), where exact identification can run."""
    resumed, undecided = 0, []
    fresh: Any = None
    try:
        done = [plan.resume and _recorded(state, p, read=False) is not None for p in paths]
        if plan.resume and state.recorded and not any(done):
            notes.append(f"--resume: none of the {state.recorded} files the state records is here unchanged "
                         "(moved, rewritten, or another DIR?): every file audited again")
        fresh = iter(run([p for p, d in zip(paths, done) if not d]))
        for i, p in enumerate(paths):
            r = _recorded(state, p) if done[i] else None
            if r is not None:
                resumed += 1
                # the stale check is the driver's, in this run's file order: redone from the recorded row
                # hashes (an earlier file may have changed or gone since), no file read; exact
                # identification's findings after it, as in a fresh run
                last = [f for f in r["findings"] if f["kind"] == "exact"]
                r["findings"] = [f for f in r["findings"] if f["kind"] not in ("stale", "exact")]
                agg.stale_check(r)
                r["findings"] += last
            else:  # a file done at the start but changed since is audited here, in its turn
                r = next(fresh) if not done[i] else run_batch(ctx, [p])[0]
                agg.stale_check(r)
                # an error no check foresaw, or a read the system failed: not done, --resume audits it again
                if not r.get("transient") and not any(f["kind"] == ERROR for f in r["findings"]):
                    state.record(r)
            agg.add(r)
            if ctx.exact_model and open_slots(r):
                undecided.append((i, int(r.get("tokens") or 0)))
            update(i + 1, len(paths))
        next(fresh, None)  # runs the executor to its end: the pool closed, the CPU times taken
    finally:
        getattr(fresh, "close", lambda: None)()  # an error mid-run: the executor's own finally now (pool, freeze)
    return resumed, undecided


def _recorded_prompts(state_path: Path, root: Path, paths: list[str]) -> list[str]:
    """The files a resumed audit's profile was built on (the state names them relative to DIR);
    bad input where some are no longer here (its profile cannot be built again)."""
    names = State.prompt_files(state_path)
    if not names:
        return []
    here = set(paths)
    files = [os.path.normpath(root / n) for n in names]
    gone = [n for n, f in zip(names, files) if f not in here]
    if gone:
        raise BadInput(f"{state_path}:1:1: its profile was built on files no longer in DIR ({', '.join(gone[:3])}"
                       f"{' ...' if len(gone) > 3 else ''}): remove the state, or run without --resume")
    return files


def _recorded(state: State, path: str, read: bool = True) -> dict[str, Any] | None:
    """The state's result for ``path`` if it is recorded and unchanged (None too for a file gone)."""
    try:
        key = file_key(path)
    except OSError:
        return None
    return state.done(key, read=read)


def _notes(notes: list[str], agg: Aggregate, plan: Plan, profile, exact: ExactRun) -> None:
    if agg.kinds.get(ERROR):
        notes.append(f"{agg.kinds[ERROR]} file(s) not audited: an error no check foresaw (a surgeon bug: please report "
                     "it); they are not recorded as done, so --resume audits them again")
    if plan.structure_only:
        notes.append("structure pass only: values and identity not checked")
    elif profile is None:
        notes.append("identity not checked: no --reference to build the target's per-point profile from")
    else:
        notes.append(profile.describe())
    if not plan.structure_only:
        notes.append(exact.describe(agg.exact_files, agg.exact_found))
    if agg.index_full_at:
        notes.append(f"the cross-file stale check indexed rows up to {agg.index_full_at}; later files were checked "
                     "against those only")
