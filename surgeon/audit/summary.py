"""An audit's verdict in words: the headline (the first line of the text and HTML reports, ``headline``
in the JSON), the faults a run whose identity is undecided cannot see, and each slot's counts.

Undecided is a verdict of its own: a slot whose identity neither the statistics nor exact
identification decided for most of its files (:attr:`surgeon.audit.aggregate.SlotAggregate.undecided`)
is not "passed": the run cannot see the faults only the identity pass finds (:data:`CANNOT_SEE`),
so the audit says so first and exits :data:`surgeon.core.errors.UNDECIDED` (4) where it found nothing
else; a finding (exit 3) wins.
"""

from __future__ import annotations

from typing import Any

# what only the identity pass finds (the values pass finds NaN/Inf, zero, constant, repeated and
# stale rows whatever the identity): the faults a run of undecided identity cannot see
CANNOT_SEE = ("labels shifted by a slot (a slot holding its neighbour's point)", "a slot off by one layer",
              "a slot holding another point (slots swapped, a wrong layer id)")


def counts(s: dict[str, Any]) -> str:
    """A slot's identity counts (its JSON): the statistics' verdicts, exact identification's, and
    the files neither decided."""
    stats = ", ".join(f"{k} {v}" for k, v in s["verdicts"].items())
    exact = ", ".join(f"{k} {v}" for k, v in s["exact_verdicts"].items() if v)
    return f"{stats}; exact: {exact or 'none'}; undecided {s['undecided']} of {s['files']}"


def histogram(s: dict[str, Any], shown: int) -> tuple[list[tuple[str, int]], int]:
    """The ``shown`` largest bars of a slot's identity histogram, and how many points it leaves out."""
    items = sorted(s["identity"].items(), key=lambda kv: -kv[1])
    return items[:shown], max(0, len(items) - shown)


def _why(j: dict[str, Any], slots: list[dict[str, Any]]) -> str:
    """Why identity is undecided: no profile, or statistics that do not separate the points, and
    what exact identification did about it."""
    if j["profile"] is None:
        return "identity not run: no --reference to profile the target"
    unresolved = sum(s["verdicts"].get("unresolved", 0) for s in slots)
    not_run = sum(s["verdicts"].get("not_run", 0) for s in slots)
    why = ("the statistics cannot tell the target's points apart" if unresolved >= not_run
           else "the statistics did not run on these slots")
    ex = j["exact"]
    if ex["model"] is None:
        return why + "; exact identification needs --reference hf:MODEL"
    return why + f"; exact identification covered {ex['escalated']} of the {ex['undecided_files']} undecided files ({ex['rule']})"


def undecided_text(j: dict[str, Any]) -> str:
    """The undecided part of the headline: which slots, why, and what the run cannot see."""
    slots = [s for s in j["slots"] if s["name"] in set(j["undecided"])]
    each = ", ".join(f"{s['name']} {s['undecided']} of {s['files']}" for s in slots)
    return (f"identity undecided for most files of {len(slots)} slot{'s' if len(slots) != 1 else ''} ({each}: "
            f"{_why(j, slots)}): this run cannot see " + ", ".join(CANNOT_SEE))


def verdict(j: dict[str, Any]) -> str:
    """error (a file hit an error no check foresaw), flagged (a finding), undecided, or ok."""
    return "error" if j["findings"].get("error") else "flagged" if j["flagged"] else \
        "undecided" if j["undecided"] else "ok"


def headline(j: dict[str, Any]) -> str:
    """The audit's first line: the verdict, what it rests on, and where identity is undecided,
    the faults the run cannot see."""
    v = verdict(j)
    found = ", ".join(f"{k} {n}" for k, n in j["findings"].items())
    if v in ("error", "flagged"):
        head = f"{v}: {j['flagged']} of {j['files']} files flagged ({found})"
        return head + (f"; {undecided_text(j)}" if j["undecided"] else "")
    if v == "undecided":
        return f"undecided: {undecided_text(j)}; no finding in {j['files']} files"
    if j["structure_only"]:
        return f"ok: every file's structure is what the spec declares ({j['files']} files; values and identity not checked)"
    open_ = [f"{s['name']} {s['undecided']} of {s['files']}" for s in j["slots"] if s.get("undecided")]
    if open_:  # fewer than half of any slot's files: not the run's verdict, but never hidden behind "every file"
        return (f"ok: no finding in {j['files']} files, identity decided for most files of every slot; still undecided "
                f"for {', '.join(open_)} files ({j['exact']['files']} identified exactly)")
    return (f"ok: every file is what the spec declares ({j['files']} files; identity decided for every file, "
            f"{j['exact']['files']} identified exactly)")
