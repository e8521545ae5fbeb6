"""One file audited, start to end: the unit of work a local process or a Ray task runs.

:func:`audit_file` takes a picklable :class:`Context` and a path and returns a plain,
JSON-serialisable dict (what the resume state stores and what crosses a process or Ray
boundary): the file's identity (path, size, mtime), its structure, each slot's values and
identity, its findings, and the sampled row hashes the driver's cross-file stale check needs.
A file the gate or a reader refuses becomes a finding (``unreadable``), not an exception.
:func:`exact_identify` adds exact identification to a file's result (the files
:mod:`surgeon.audit.exact` selects); the driver runs it, so the target model is loaded by one
process, never by every worker at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from surgeon.audit.heap import settle_owned
from surgeon.audit.profile import Profile, match_slot
from surgeon.audit.rows import FLOATS
from surgeon.audit.structure import Structure, check_structure, read_structure
from surgeon.core.errors import BadInput, ReadFailure
from surgeon.core.points import Point, parse_point

_SPECS: dict[str, Any] = {}


@dataclass(frozen=True)
class Context:
    spec_path: str
    profile: Profile | None = None
    exact_model: str | None = None  # an HF model folder: exact identification on the file's own tokens
    structure_only: bool = False

    @property
    def spec(self):
        if self.spec_path not in _SPECS:
            from surgeon.core.spec import load_spec

            _SPECS[self.spec_path] = load_spec(self.spec_path)
        return _SPECS[self.spec_path]


BATCH = 8  # files per task: amortises the per-task cost of a pool or a Ray task over small files


def batches(items: list[str], size: int) -> Iterator[list[str]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def run_batch(ctx: Context, batch: list[str]) -> list[dict[str, Any]]:
    """One task: a few files audited in order (what a worker process or a Ray task runs)."""
    return [audit_file(ctx, path) for path in batch]


_WORKER_CTX: list[Context] = []  # a pool worker's context, set once when it starts (nothing pickled per task)


def init_worker(ctx: Context, driver: int | None = None) -> None:
    """A local pool worker's start: one torch thread (a worker is a core; threads of two workers on
    two cores stall each other at barriers; and a forked child must not enter the OpenMP pool its
    parent used), Ctrl-C ignored (the driver's, which shuts the pool down: no traceback from every
    worker), its context kept for every batch, and its life tied to the driver's (pid ``driver``):
    a driver killed with SIGKILL leaves no worker behind (:func:`die_with`)."""
    import signal

    import torch

    if driver is not None:
        die_with(driver)
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle: it stops the pool
    _WORKER_CTX[:] = [ctx]
    settle_owned(collect=False)  # forked: the driver collected before it forked


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_S = 1.0  # where the kernel cannot signal a parent's death: how often a worker looks for its parent


def die_with(driver: int) -> None:
    """End this process when the process ``driver`` (its parent) ends, however it ends (SIGKILL
    included, where no handler of the driver runs to stop its pool): on Linux the kernel sends
    SIGKILL at the parent's death (``prctl(PR_SET_PDEATHSIG)``); elsewhere a daemon thread looks
    for the parent every :data:`WATCH_S` seconds. A parent already gone when this runs: the
    process ends now."""
    import signal
    import sys

    armed = False
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):  # no prctl in this libc: the watch below
            armed = False
    if os.getppid() != driver:  # died before the signal was armed (the kernel then sends none)
        os._exit(1)
    if not armed:
        import threading

        threading.Thread(target=_watch, args=(driver,), name="surgeon-parent-watch", daemon=True).start()


def _watch(driver: int) -> None:
    import time

    while os.getppid() == driver:
        time.sleep(WATCH_S)
    os._exit(1)


def run_batch_owned(ctx: Context, batch: list[str]) -> list[dict[str, Any]]:
    """A Ray task: :func:`run_batch` in a worker process the audit owns, settled before its first file."""
    settle_owned()
    return run_batch(ctx, batch)


def run_batch_here(batch: list[str]) -> tuple[list[dict[str, Any]], int, float]:
    """A pool worker's task: :func:`run_batch` with the context :func:`init_worker` kept, this
    process's id and the CPU seconds it has used so far (parallel efficiency is judged by them)."""
    import time

    return run_batch(_WORKER_CTX[0], batch), os.getpid(), time.process_time()


def file_key(path: str | Path) -> dict[str, Any]:
    """What says a file is the one already audited: its path, size and mtime (ns)."""
    st = os.stat(path)
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _declared(spec, layout: str, names: list[str], points: list[str] | None = None) -> tuple[list[str], list[Point | None]]:
    """Slot names and the points the spec declares for them: the slots of a file that records them
    (a surgeon dump's header, a stack's capture sidecar: ``points``) by their own names (a sidecar's
    name the spec does not capture at its recorded point); any other layout's in that layout's own
    order (:meth:`surgeon.core.spec.Spec.slot_order`: SpecForge's aux in fc order then its final-norm
    hidden_state, a stack by ascending depth)."""
    if layout == "surgeon":
        return names, [spec.captures.get(n) for n in names]
    if points is not None and len(points) == len(names):
        recorded = [parse_point(pt, spec.num_layers, allow_delta=True) for pt in points]
        return names, [spec.captures.get(n, r) for n, r in zip(names, recorded)]
    order, _ = spec.slot_order(layout)
    names = order[: len(names)] + names[len(order):]
    return names, [spec.captures.get(n) for n in names]


def _finding(kind: str, slot: str | None, detail: str) -> dict[str, Any]:
    return {"kind": kind, "slot": slot, "detail": detail}


VALUE_LAYOUTS = ("specforge", "speculators", "surgeon")  # the layouts whose slots are values to check
VALUE_DTYPES = tuple(FLOATS.values())  # the slot dtypes the value pass reads: the float ones a plan may read
ERROR = "error"  # the finding of a file whose audit hit an error no check foresaw


def audit_file(ctx: Context, path: str) -> dict[str, Any]:
    """Audit one file: its structure, values and identity (exact identification is
    :func:`exact_identify`'s, run by the driver)."""
    out: dict[str, Any] = {"path": str(path), "size": 0, "mtime_ns": None, "layout": None, "tokens": None, "slots": [],
                           "findings": [], "hashes": [], "exact": None}
    try:
        out.update(file_key(path))
    except OSError as e:  # gone since the set was listed
        out["findings"].append(_finding("unreadable", None, f"{path}: {e.strerror or e}"))
        return out
    try:
        st = read_structure(path)
        _structure_part(ctx, st, out)
        if not ctx.structure_only and st.layout in VALUE_LAYOUTS:
            bad = sorted({d for d in st.dtypes if d not in VALUE_DTYPES})
            if bad:
                out["findings"].append(_finding("structure", None, f"values not checked: slots of dtype {', '.join(bad)} "
                                                                   f"(the value pass reads {', '.join(VALUE_DTYPES)})"))
            else:
                _value_part(ctx, path, st, out)
    except BadInput as e:
        out["findings"].append(_finding("unreadable", None, str(e).splitlines()[0] if str(e) else type(e).__name__))
        if isinstance(e, ReadFailure):  # the system's, not the file's: not done (--resume reads it again)
            out["transient"] = True
    except Exception as e:  # noqa: BLE001 - no check foresaw it: said on that file, the audit goes on (exit 1)
        out["findings"].append(_finding(ERROR, None, f"not audited: {type(e).__name__}: "
                                                     f"{(str(e).splitlines() or [''])[0][:200]}"))
    return out


def _structure_part(ctx: Context, st: Structure, out: dict[str, Any]) -> None:
    out["layout"], out["tokens"] = st.layout, st.tokens
    names, declared = _declared(ctx.spec, st.layout, st.names, st.points)
    out["slots"] = [{"name": n, "declared": None if d is None else str(d), "dtype": dt}
                    for n, d, dt in zip(names, declared, st.dtypes)]
    for f in check_structure(st, ctx.spec):
        out["findings"].append(_finding("structure", None, f))


def _subject_slots(path: str, spec) -> tuple[list, Any]:
    from surgeon.verify.subjects import read_subject

    subject = read_subject(path, num_layers=spec.num_layers)
    return [t for _, _, t in subject.slots], subject.input_ids


def _specforge_slots(st: Structure, path: str) -> tuple[list, Any, list]:
    """The slots of a SpecForge dict (loaded again with its data where the structure pass loaded
    it onto the meta device): the aux states split by the hidden width, then ``hidden_state``, as
    :func:`surgeon.verify.subjects.read_subject` reads them; and their per-row norms, each tensor's
    slots in one pass (``[T, k, H]`` viewed)."""
    import torch

    from surgeon.audit.norms import row_norms
    from surgeon.audit.structure import specforge_data

    data, H = specforge_data(st, path), st.hidden
    aux, hidden = data["aux_hidden_state"], data.get("hidden_state")
    width = aux.shape[-1] if aux.dim() else 0
    if not isinstance(hidden, torch.Tensor) or not H or not st.tokens or not width or width % H \
            or hidden.numel() != st.tokens * H or aux.numel() != st.tokens * width:
        raise BadInput(f"aux_hidden_state {list(aux.shape)} and hidden_state "
                       f"{list(hidden.shape) if isinstance(hidden, torch.Tensor) else None}: no way to split the slots")
    aux = aux.reshape(-1, width)
    k = width // H
    tensors = [aux[:, i * H:(i + 1) * H] for i in range(k)]
    tensors.append(hidden.reshape(-1, H))
    norms = list(row_norms(aux.reshape(-1, k, H)).unbind(1)) if aux.is_contiguous() else [None] * k
    norms.append(None)
    ids = data.get("input_ids")  # ids that are no tensor, or not one per row, are a structure finding: not used here
    ok = isinstance(ids, torch.Tensor) and ids.numel() == st.tokens
    return tensors, ids.reshape(-1) if ok else None, norms


def _gathered(st: Structure, path: str, spec) -> tuple[Any, Any, int]:
    """What the value pass takes of the file's slots (:class:`~surgeon.audit.values.Gathered`),
    its token ids and its slot count: read in chunks where the structure located the rows, else
    through the tensors."""
    from surgeon.audit.values import gather_file, gather_tensors

    if st.rows is not None:
        from surgeon.audit.rows import read_ids

        return gather_file(st.rows), read_ids(st.rows), st.rows.slots
    if st.loaded is not None:
        tensors, ids, norms = _specforge_slots(st, path)
    else:
        tensors, ids = _subject_slots(path, spec)
        norms = [None] * len(tensors)
    return gather_tensors(tensors, norms), ids, len(tensors)


def _value_part(ctx: Context, path: str, st: Structure, out: dict[str, Any]) -> None:
    from surgeon.audit.profile import file_stats
    from surgeon.audit.values import gathered_values, repeated_rows, sampled_rows

    spec = ctx.spec
    g, ids, count = _gathered(st, path, spec)
    names, declared = _declared(spec, st.layout, st.names if len(st.names) == count
                                else [f"slot{i}" for i in range(count)], st.points)
    first = int(ids[0]) if ids is not None and ids.numel() else None
    svs, hashes, moments = gathered_values(names, declared, g)
    stats: list = [None] * len(svs)
    dists: list = [None] * len(svs)
    profile = None if ctx.profile is None else ctx.profile.at(int(g.norms.shape[1]))  # the rung of its length
    if profile is not None:
        stats = file_stats(svs, moments, first, list(g.first.unbind(0)), tokens=int(g.norms.shape[1]))
        dists = profile.distances_of(stats)
    slots = []
    for sv, stat, dist in zip(svs, stats, dists):
        row = asdict(sv)  # the slot's row of the file's result (the state records it)
        row["identity"] = match_slot(profile, sv.declared, stat, dist)
        slots.append(row)
        for f in sv.findings:
            kind, _, detail = f.partition(": ")
            out["findings"].append(_finding(kind, sv.name, detail))
        ident = row["identity"]
        if ident["verdict"] in ("mismatch", "no_match"):
            if ident.get("by_anchor"):  # the statistics fit several points; position 0 told them apart
                what = (f"its statistics fit several points; its first row is {ident['nearest']}'s state at "
                        f"position 0 (the profile's first token), not {sv.declared}'s")
            else:
                what = ("its statistics: " + (f"holds {ident['nearest']}" if ident["nearest"] else "fits no point of the target")
                        + f" ({ident['distance']:.1f} tolerances from the declared)")
            out["findings"].append(_finding("identity", sv.name, f"declared {sv.declared}, {what}"))
    for name, detail in repeated_rows(names, declared, hashes, ids):
        kind, _, rest = detail.partition(": ")
        out["findings"].append(_finding(kind, name, rest))
    out["slots"] = slots
    out["hashes"] = sampled_rows(declared, hashes, ids)


def exact_identify(ctx: Context, out: dict[str, Any]) -> None:
    """Exact identification of an audited file (its result ``out``, updated in place): each slot
    against the target run on the file's own tokens. Run by the driver, one file at a time, so the
    target model is in memory once however many workers audit the rest (each exact file loads it)."""
    if ctx.structure_only or not ctx.exact_model or out.get("layout") not in VALUE_LAYOUTS \
            or any(f["kind"] == "unreadable" for f in out["findings"]):
        return
    try:
        _exact_part(ctx, out["path"], out)
    except BadInput as e:
        out["findings"].append(_finding("unreadable", None, str(e).splitlines()[0] if str(e) else type(e).__name__))


def _exact_part(ctx: Context, path: str, out: dict[str, Any]) -> None:
    from surgeon.verify.harness import match

    res = match(path, f"hf:{ctx.exact_model}", spec=ctx.spec)
    out["exact"] = [{"name": s.name, "declared": None if s.declared is None else str(s.declared),
                     "matched": None if s.matched is None else str(s.matched), "verdict": s.verdict}
                    for s in res.report.slots]
    # "undecided": the slot fits several points about equally on its own tokens, its declared one
    # among them: no finding (the slot stays undecided)
    wrong = [s for s in out["exact"] if s["verdict"] not in ("ok", "undecided")]
    for s in wrong:
        out["findings"].append(_finding("exact", s["name"], f"declared {s['declared']}, identified on its own "
                                                            f"tokens as {s['matched'] or 'no point'} ({s['verdict']})"))
    if wrong:
        out["diagnosis"] = [f"{d.kind}: {d.detail}" for d in res.report.diagnosis]
