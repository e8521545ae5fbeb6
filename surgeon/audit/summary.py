"""An audit's verdict in words: the headline (the first line of the text and HTML reports, ``headline``
in the JSON), the faults a run whose identity is undecided cannot see, and each slot's counts.

Undecided is a verdict of its own: a slot whose identity neither the statistics nor exact
identification decided for most of its files (:attr:`surgeon.audit.aggregate.SlotAggregate.mostly_undecided`)
is not "passed": the run cannot see the faults only the identity pass finds (:data:`CANNOT_SEE`),
so the audit says so first and exits :data:`surgeon.core.errors.UNDECIDED` (4) where it found nothing
else; a finding (exit 3) wins.
"""

from __future__ import annotations

from typing import Any

from surgeon.audit.output import AuditSlot

# what only the identity pass finds (the values pass finds NaN/Inf, zero, constant, repeated and
# stale rows whatever the identity): the faults a run of undecided identity cannot see
CANNOT_SEE = ("labels shifted by a slot (a slot holding its neighbour's point)", "a slot off by one layer",
              "a slot holding another point (slots swapped, a wrong layer id)")


def counts(s: AuditSlot) -> str:
    """A slot's identity counts (its :class:`surgeon.audit.output.AuditSlot`): the statistics'
    verdicts, exact identification's, and the files neither decided."""
    stats = ", ".join(f"{k} {v}" for k, v in s.verdicts.items())
    exact = ", ".join(f"{k} {v}" for k, v in s.exact_verdicts.items() if v)
    return f"{stats}; exact: {exact or 'none'}; undecided {s.undecided} of {s.files}"


def histogram(s: AuditSlot, shown: int) -> tuple[list[tuple[str, int]], int]:
    """The ``shown`` largest bars of a slot's identity histogram, and how many points it
    leaves out."""
    items = sorted(s.identity.items(), key=lambda kv: -kv[1])
    return items[:shown], max(0, len(items) - shown)


# The functions below read an audit's report (:class:`surgeon.audit.pipeline.AuditReport`) by the
# names of its JSON's keys: its slots are SlotAggregates, its exact an ExactReport, read so too.


def _why(r: Any, slots: list[Any]) -> str:
    """Why identity is undecided: no profile, or statistics that do not separate the points, and
    what exact identification did about it."""
    if r.profile is None:
        return "identity not run: no --reference to profile the target"
    unresolved = sum(s.verdicts.get("unresolved", 0) for s in slots)
    not_run = sum(s.verdicts.get("not_run", 0) for s in slots)
    why = ("the statistics cannot tell the target's points apart" if unresolved >= not_run
           else "the statistics did not run on these slots")
    ex = r.exact
    if ex.model is None:
        return why + "; exact identification needs --reference hf:MODEL"
    return why + f"; exact identification covered {ex.escalated} of the {ex.undecided_files} undecided files ({ex.rule})"


def undecided_text(r: Any) -> str:
    """The undecided part of the headline: which slots, why, and what the run cannot see."""
    slots = [s for s in r.slots if s.name in set(r.undecided)]
    each = ", ".join(f"{s.name} {s.undecided} of {s.files}" for s in slots)
    return (f"identity undecided for most files of {len(slots)} slot{'s' if len(slots) != 1 else ''} ({each}: "
            f"{_why(r, slots)}): this run cannot see " + ", ".join(CANNOT_SEE))


def verdict(r: Any) -> str:
    """error (a file hit an error no check foresaw), flagged (a finding), undecided, or ok."""
    return "error" if r.findings.get("error") else "flagged" if r.flagged else \
        "undecided" if r.undecided else "ok"


def headline(r: Any) -> str:
    """The audit's first line: the verdict, what it rests on, and where identity is undecided,
    the faults the run cannot see."""
    v = verdict(r)
    found = ", ".join(f"{k} {n}" for k, n in r.findings.items())
    if v in ("error", "flagged"):
        head = f"{v}: {r.flagged} of {r.files} files flagged ({found})"
        return head + (f"; {undecided_text(r)}" if r.undecided else "")
    if v == "undecided":
        return f"undecided: {undecided_text(r)}; no finding in {r.files} files"
    if r.structure_only:
        return f"ok: every file's structure is what the spec declares ({r.files} files; values and identity not checked)"
    open_ = [f"{s.name} {s.undecided} of {s.files}" for s in r.slots if s.undecided]
    if open_:  # fewer than half of any slot's files: not the run's verdict, but never hidden behind "every file"
        return (f"ok: no finding in {r.files} files, identity decided for most files of every slot; still undecided "
                f"for {', '.join(open_)} files ({r.exact.files} identified exactly)")
    return (f"ok: every file is what the spec declares ({r.files} files; identity decided for every file, "
            f"{r.exact.files} identified exactly)")
