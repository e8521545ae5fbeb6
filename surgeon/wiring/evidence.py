"""What an engine answer rests on, in words: the source lines read (setter, loop, capture sites,
the model runner's call) and the notes that follow from them in that release.

Render, explain, lint and check-draft all print these, so a note such as "the setter sorts the
ids" appears only where the setter read in that release sorts them, with its file:line, and an
answer resting on code the probe did not read says "unverified" and why. Runner evidence
(``Evidence(role="runner")`` on the convention, filled where the engine's model runner is read)
is printed like the rest; :data:`EXTRA_NOTES` lets another reader add notes of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from surgeon.core.idrules import ClassConvention, SiteRecord

# Extra note makers (convention, capture indices, layer count) -> notes, e.g. from the model
# runner's reading; each is called for every answer about an engine class.
EXTRA_NOTES: list[Callable[[ClassConvention, Sequence[int], int], list[str]]] = []
# Extra refusers (convention, capture indices, layer count) -> why the engine cannot serve those
# indices (with file:line), or None; render and lint refuse on the first reason (the model runner's
# reading plugs in here: a release whose runner ignores the draft's ids).
EXTRA_REFUSALS: list[Callable[[ClassConvention, Sequence[int], int], str | None]] = []


def refusal(cc: ClassConvention, positions: Sequence[int], num_layers: int) -> str | None:
    """The first reason an extra reader (the runner) gives why ``positions`` cannot be served."""
    for refuse in EXTRA_REFUSALS:
        why = refuse(cc, positions, num_layers)
        if why is not None:
            return why
    return None


def unverified_note(cc: ClassConvention, positions: Sequence[int] | None = None,
                    num_layers: int | None = None) -> str | None:
    """``unverified: <reason>`` when the answer about ``positions`` rests on code the probe did
    not read (all of the class's sites when no positions are given)."""
    why = cc.unverified_for(positions, num_layers)
    if why is None:
        return None
    return f"unverified: {cc.class_name} ({cc.path}:{cc.line}): {why}"


def order_note(cc: ClassConvention) -> str | None:
    """How the engine orders and de-duplicates captures, from the setter and loop read."""
    setter = cc.evidence_of("setter")
    loop = cc.evidence_of("loop")
    where_setter = ", storing at ".join(f"{e.path}:{e.line}" for e in setter[:2]) if setter else (cc.setter_owner or cc.path)
    where_loop = f"{loop[0].path}:{loop[0].line}" if loop else (cc.loop_owner or cc.path)
    if cc.sorts:
        return (f"{cc.engine}: the setter ({where_setter}) sorts the ids, and the loop ({where_loop}) captures each "
                f"layer once: ids are written ascending, in fc order")
    if cc.emit_order == "layer":
        return (f"{cc.engine}: the setter ({where_setter}) keeps the ids as given, but the loop ({where_loop}) "
                f"captures by a membership test, once per layer, in layer order: ids are written ascending, in fc order")
    return None


def evidence_lines(cc: ClassConvention, positions: Sequence[int] = (), num_layers: int | None = None) -> list[str]:
    """file:line of the setter, the loop, the capture site of each position (all sites when no
    positions are given) and the runner call, one line each."""
    out = [str(e) for e in cc.evidence if e.role in ("setter", "loop")]
    if positions and num_layers is not None:
        by_site: dict[SiteRecord, list[int]] = {}
        for p in positions:
            site = cc.site_for(p, num_layers)
            if site is not None:
                by_site.setdefault(site, []).append(p)
        for site, ps in by_site.items():
            which = f"index {ps[0]}" if len(ps) == 1 else f"indices {', '.join(map(str, ps))}"
            out.append(f"capture_site: {which}: {site.path}:{site.line}: {site.where}: {site.expression}"
                       + ("" if site.verified else f" (unverified: {site.unverified_reason})"))
    else:
        out.extend(str(e) for e in cc.evidence if e.role == "capture_site")
    out.extend(str(e) for e in cc.evidence if e.role not in ("setter", "loop", "capture_site"))
    return out


def engine_notes(cc: ClassConvention, positions: Sequence[int] = (), num_layers: int | None = None) -> list[str]:
    """Every note an answer about ``cc`` carries: unverified first, then ordering and the extra
    readers' notes (runner)."""
    notes = [n for n in (unverified_note(cc, positions if num_layers is not None else None, num_layers),
                         order_note(cc)) if n]
    if num_layers is not None:
        for make in EXTRA_NOTES:
            notes.extend(make(cc, positions, num_layers))
    return notes
