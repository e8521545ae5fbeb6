"""`surgeon review OLD NEW`: a pull-request comment saying what changed physically.

A reviewer sees, per capture, the point it was and is, the fc slots that now read something else
(the change that silently costs acceptance), and each engine's ids before and after.
"""

from __future__ import annotations

from dataclasses import dataclass

from surgeon.core.errors import BadInput
from surgeon.core.spec import Spec
from surgeon.wiring.render import IdList, fc_ids

_TARGETS = (("sglang", "SGLang `eagle_config` ids"), ("vllm", "vLLM `eagle_aux_hidden_state_layer_ids`"),
            ("eagle", "SpecForge / EAGLE config ids"), ("hf", "HF `hidden_states` indices"))


@dataclass(frozen=True)
class CaptureChange:
    """One capture's point in the old spec and in the new (None: not there)."""

    name: str
    was: str | None
    now: str | None


@dataclass(frozen=True)
class IdsChange:
    """One consumer's fc ids for the old spec and for the new (None: no fc input, or not expressible)."""

    target: str
    before: list[int] | None
    after: list[int] | None


@dataclass
class Review:
    """The pull-request comment, and what it rests on: the two files, whether the fc input changed
    physically, each capture's point and each consumer's ids before and after."""

    markdown: str
    old: str
    new: str
    fc_changed: bool
    captures: list[CaptureChange]
    ids: list[IdsChange]


def _md(value: object) -> str:
    """Text from a spec, safe inside a Markdown table cell and inline code."""
    return str(value).replace("\\", "\\\\").replace("`", "'").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


class _Notes:
    """Footnotes of a table: each distinct text once, numbered in order of first use, written as
    an ordered list after the table (a line right under a table would be one more row on GitHub)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"note {self.texts.index(text) + 1}"

    def lines(self) -> list[str]:
        return [f"{i}. {t}" for i, t in enumerate(self.texts, 1)] + ([""] if self.texts else [])


def _ids_text(lst: IdList, notes: _Notes) -> str:
    return f"`{lst.ids}`" if lst.ok else f"not expressible ({notes.ref(_md(lst.error))})"


def _fc_ids(spec: Spec, target: str, root) -> IdList | None:
    if not spec.fc_names:
        return None
    try:
        return fc_ids(spec, target, engine_root=root)
    except BadInput as e:
        return IdList(target, "", None, f"unavailable: {e}")


def _pin_cell(value: object) -> str:
    """A pin field as a Markdown table cell: code, or a dash when the pin lacks it."""
    return f"`{_md(value)}`" if value is not None else "—"


def _pin_rows(old: Spec, new: Spec) -> list[str]:
    rows = []
    for engine in ("sglang", "vllm"):
        a, b = old.pin(engine), new.pin(engine)
        for fld in ("version", "model_file", "model_class", "ids", "offset"):
            va = getattr(a, fld) if a else None
            vb = getattr(b, fld) if b else None
            if va != vb:
                rows.append(f"| {engine} | `{fld}` | {_pin_cell(va)} | {_pin_cell(vb)} |")
    return rows


def review(old: Spec, new: Spec, *, roots: dict[str, str | None] | None = None) -> Review:
    """The Markdown comment (header, captures, fc input, engine ids, dumps, pins) and its data."""
    roots = roots or {}
    lines = _header_lines(old, new)
    fc_old = list(zip(old.fc_names, old.fc_points))
    fc_new = list(zip(new.fc_names, new.fc_points))
    fc_changed = [p for _, p in fc_old] != [p for _, p in fc_new]
    if fc_changed:
        lines.append("> [!WARNING]")
        lines.append("> The draft's fc input changed physically: a draft trained on the old wiring now reads other states "
                     "(acceptance drops without any error). Retrain the draft, or keep the old wiring.")
        lines.append("")
    elif fc_old != fc_new:
        lines.append("fc input renamed only: every slot reads the same physical state.")
        lines.append("")
    cap_rows = _capture_section(old, new, lines)
    _fc_section(fc_old, fc_new, lines)
    ids_rows = _engine_ids_section(old, new, roots, lines)
    _dumps_and_pins_sections(old, new, lines)
    return Review("\n".join(lines).rstrip() + "\n", old.file, new.file, fc_changed, cap_rows, ids_rows)


def _header_lines(old: Spec, new: Spec) -> list[str]:
    lines: list[str] = []
    title = _md(old.name if old.name == new.name else f"{old.name} → {new.name}")
    lines.append(f"### surgeon review: `{title}`")
    lines.append("")
    lines.append(f"`{_md(old.file)}` (sha256 `{old.sha256[:12]}`) → `{_md(new.file)}` (sha256 `{new.sha256[:12]}`)")
    lines.append("")
    t0, t1 = old.model.target, new.model.target
    if old.num_layers != new.num_layers or old.hidden_size != new.hidden_size or t0.architecture != t1.architecture:
        lines.append(f"**Target changed:** {_md(t0.architecture)} L={t0.num_layers} H={t0.hidden_size} → "
                     f"{_md(t1.architecture)} L={t1.num_layers} H={t1.hidden_size}")
        lines.append("")
    return lines


def _capture_section(old: Spec, new: Spec, lines: list[str]) -> list[CaptureChange]:
    """The captures table (appended to ``lines``); returns its rows."""
    lines.append("#### Captures")
    lines.append("| capture | was | now | |")
    lines.append("|---|---|---|---|")
    names = list(old.captures) + [n for n in new.captures if n not in old.captures]
    cap_rows = []
    for n in names:
        a, b = old.captures.get(n), new.captures.get(n)
        change = "added" if a is None else "removed" if b is None else "**changed**" if a != b else ""
        lines.append(f"| `{_md(n)}` | {a or '—'} | {b or '—'} | {change} |")
        cap_rows.append(CaptureChange(n, str(a) if a else None, str(b) if b else None))
    lines.append("")
    return cap_rows


def _fc_section(fc_old: list, fc_new: list, lines: list[str]) -> None:
    lines.append("#### fc input (the order the draft's fc concatenates)")
    lines.append("| slot | was | now | |")
    lines.append("|---|---|---|---|")
    for i in range(max(len(fc_old), len(fc_new))):
        a = fc_old[i] if i < len(fc_old) else None
        b = fc_new[i] if i < len(fc_new) else None
        flag = "**changed**" if (a and a[1]) != (b and b[1]) else ""
        lines.append(f"| {i} | {f'`{_md(a[0])}` = {a[1]}' if a else '—'} | {f'`{_md(b[0])}` = {b[1]}' if b else '—'} | {flag} |")
    lines.append("")


def _engine_ids_section(old: Spec, new: Spec, roots: dict[str, str | None], lines: list[str]) -> list[IdsChange]:
    """Each consumer's ids before and after (appended to ``lines``), then the notes the cells refer
    to and where each engine's rule was read, below the table; returns the rows."""
    lines.append("#### Engine ids")
    lines.append("| consumer | before | after |")
    lines.append("|---|---|---|")
    ids_rows = []
    origins: list[str] = []
    notes = _Notes()
    for target, label in _TARGETS:
        root = roots.get(target)
        before = _fc_ids(old, target, root)
        after = _fc_ids(new, target, root)
        either = after or before
        conv = either.convention if either else target
        cells = [_ids_text(x, notes) if x else "—" for x in (before, after)]
        lines.append(f"| {label} (`{conv}`) | {cells[0]} | {cells[1]} |")
        ids_rows.append(IdsChange(target, before.ids if before else None, after.ids if after else None))
        if target in ("sglang", "vllm") and after is not None and after.origin and after.origin not in origins:
            origins.append(after.origin)  # where each engine's rule was read: a probe, or the built-in table
    lines.append("")
    lines.extend(notes.lines())
    if origins:
        lines.append("<sub>engine rules read from: " + "; ".join(_md(o) for o in origins) + "</sub>")
        lines.append("")
    return ids_rows


def _dumps_and_pins_sections(old: Spec, new: Spec, lines: list[str]) -> None:
    """The dump layout and the engine pins, each only when it changed."""
    d0 = old.model.dumps
    d1 = new.model.dumps
    if d0 != d1:
        lines.append("#### Dumps")
        lines.append(f"- was: {_md(d0.layout + ' ' + str(old.dump_slots)) if d0 else 'none'}")
        lines.append(f"- now: {_md(d1.layout + ' ' + str(new.dump_slots)) if d1 else 'none'}")
        lines.append("")
    pins = _pin_rows(old, new)
    if pins:
        lines.append("#### Engine pins")
        lines.append("| engine | field | before | after |")
        lines.append("|---|---|---|---|")
        lines.extend(pins)
        lines.append("")
