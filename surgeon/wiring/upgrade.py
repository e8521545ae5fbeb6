"""`surgeon upgrade-check`: what moving a deployment from one engine release to another changes
for the specs it serves, read from both releases' source (never imported).

Per spec: the ids each release renders (or its refusal), and the verdict on the draft config
already deployed, which keeps the ids the OLD release rendered: that fragment is checked against
the NEW release exactly as ``check-draft`` checks a draft (its runner's config reads, the model
class's setter, its capture sites), and against the old one for a baseline:

* ``same``: the new release feeds the fc the spec's points, verified;
* ``differently``: the new release captures other points (or cannot serve them) where the old one
  served the spec's, verified: exit 3;
* ``undecided``: either answer rests on code the probe did not read (or the new release cannot
  say what the class's ids mean): exit 4, with what was not read;
* ``not_deployed``: the old release refuses the spec, so no draft config was rendered by it.

Per model class (the specs' classes first, then every class either probe found), what changed in
its meaning: presence, status, the setter's id rule, the default, sorting and emit order, the
capture sites (where, what value, which expression, which file) and whether the answer is
verified; and what the model runner reads: its setter calls and the draft-config keys they read.
Each change carries file:line on both sides; a line that only moved is not a change.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from surgeon.core.errors import UNDECIDED, BadInput
from surgeon.core.idrules import ClassConvention, EngineProbe
from surgeon.core.runnerfacts import RunnerCall, RunnerModel
from surgeon.core.spec import Spec
from surgeon.engines.view import model_class_for, open_engine, platform_scope
from surgeon.wiring.draft import DraftReport, check_draft
from surgeon.wiring.render import Rendering, render

Served = Literal["same", "differently", "undecided", "not_deployed"]
_LINE = re.compile(r"(\S+?\.py):\d+")


def _unplaced(text: str) -> str:
    """``text`` without line numbers (``a/b.py:12`` -> ``a/b.py``): what a change is compared on, so
    that code which only moved is not reported."""
    return _LINE.sub(r"\1", text)


@dataclass(frozen=True)
class Release:
    engine: str
    version: str
    root: str


@dataclass(frozen=True)
class Change:
    """One thing that differs between the releases: ``aspect`` of ``subject`` (a class key, or
    ``runner``) as each release reads (None: absent there), with the file:line it rests on in each
    (paths relative to that release's root)."""

    subject: str
    aspect: str
    before: str | None
    after: str | None
    before_at: list[str] = field(default_factory=list)
    after_at: list[str] = field(default_factory=list)

    @property
    def summary(self) -> str:
        return f"{self.subject}: {self.aspect}: {self.before or 'none'} -> {self.after or 'none'}"


@dataclass
class ClassDiff:
    class_name: str  # the probe's key: the class name, or path:Class where names repeat
    in_specs: bool
    changes: list[Change]


@dataclass
class SpecUpgrade:
    """One spec across the upgrade: ids before and after, and the verdict on its deployed config."""

    spec: str
    file: str
    model_class: str
    before: list[int] | None
    after: list[int] | None
    refused_before: str | None
    refused_after: str | None
    deployed: dict | None  # the draft-config fragment the old release renders: what is deployed
    served: Served
    captured_before: list[str | None]
    captured_after: list[str | None]
    reasons: list[str]  # why differently / undecided / not deployed, with file:line
    evidence_before: list[str]
    evidence_after: list[str]

    @property
    def ids_changed(self) -> bool:
        return self.before != self.after


@dataclass
class UpgradeReport:
    engine: str
    platform: str
    before: Release
    after: Release
    specs: list[SpecUpgrade]
    classes: list[ClassDiff]  # classes with at least one change
    runner: list[Change]
    classes_compared: int

    @property
    def served_differently(self) -> list[str]:
        return [s.spec for s in self.specs if s.served == "differently"]

    @property
    def undecided(self) -> list[str]:
        return [s.spec for s in self.specs if s.served == "undecided"]

    @property
    def changed(self) -> bool:
        return bool(self.classes or self.runner or any(s.ids_changed or s.served != "same" for s in self.specs))

    @property
    def exit_code(self) -> int:
        return 3 if self.served_differently else UNDECIDED if self.undecided else 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


# ---------------------------------------------------------------------------------------------
# the whole check
# ---------------------------------------------------------------------------------------------
def upgrade_check(specs: Sequence[Spec], engine: str, old_root: str, new_root: str,
                  platform: str | None = None) -> UpgradeReport:
    """What moving ``engine`` from the release at ``old_root`` to the one at ``new_root`` changes for
    ``specs`` and for every model class (see the module's doc)."""
    with platform_scope(platform) if platform else contextlib.nullcontext():
        old, old_probe = _release(engine, old_root)
        new, new_probe = _release(engine, new_root)
        rows = [_spec_upgrade(s, engine, old, new, new_probe) for s in specs]
        spec_classes = list(dict.fromkeys(r.model_class for r in rows))
        classes = class_changes(old_probe, new_probe, spec_classes)
        runner = runner_changes(old_probe.runner, new_probe.runner)
        compared = len(set(old_probe.classes) | set(new_probe.classes))
        return UpgradeReport(engine, new_probe.platform, old, new, rows, classes, runner, compared)


def _release(engine: str, root: str) -> tuple[Release, EngineProbe]:
    view = open_engine(engine, root)
    if view.probe is None or view.location is None:
        raise BadInput(f"{root}: no {engine} release to read there")
    return Release(engine, view.probe.version, str(view.location.root)), view.probe


# ---------------------------------------------------------------------------------------------
# specs: ids before and after, and the deployed config under the new release
# ---------------------------------------------------------------------------------------------
def _rendered(spec: Spec, engine: str, root: str) -> tuple[Rendering | None, str | None]:
    """The release's rendering of ``spec``, or why it refuses (the reason alone, file:line in it)."""
    try:
        return render(spec, engine, engine_root=root), None
    except BadInput as e:
        text = getattr(e, "reason", None) or str(e)
        return None, text.removeprefix(f"{spec.file}: ").removeprefix(f"cannot render for {engine}: ")


def _spec_upgrade(spec: Spec, engine: str, old: Release, new: Release, new_probe: EngineProbe) -> SpecUpgrade:
    cls = model_class_for(spec, engine)
    before, refused_before = _rendered(spec, engine, old.root)
    after, refused_after = _rendered(spec, engine, new.root)
    row = SpecUpgrade(spec.name, spec.file, cls, before.ids if before else None, after.ids if after else None,
                      refused_before, refused_after, before.draft_config if before else None, "not_deployed",
                      [], [], [], before.evidence if before else [], after.evidence if after else [])
    if before is None:
        row.reasons = [f"{engine} {old.version} refuses this spec, so no draft config of its rendering is deployed: "
                       f"{refused_before}"]
        return row
    _judge(row, spec, engine, old, new, new_probe)
    return row


def _judge(row: SpecUpgrade, spec: Spec, engine: str, old: Release, new: Release, new_probe: EngineProbe) -> None:
    """Fill ``row``'s verdict: the deployed fragment checked as a draft config on both releases."""
    with _deployed(row.deployed or {}) as draft:
        was = check_draft(spec, draft, engine, engine_root=old.root)
        if old.root == new.root:  # one release read twice: nothing can be served otherwise
            row.captured_before = row.captured_after = was.captured
            row.served = "same"
            return
        try:
            now = check_draft(spec, draft, engine, engine_root=new.root)
        except BadInput as e:
            row.captured_before = was.captured
            row.served, row.reasons = _without_class(new_probe, row.model_class, new, str(e))
            return
    row.captured_before, row.captured_after = was.captured, now.captured
    row.served, row.reasons = verdict(was, now, old, new)


@contextlib.contextmanager
def _deployed(fragment: dict) -> Iterator[Path]:
    """A draft folder whose config.json is ``fragment``: the deployed config, for ``check_draft``."""
    with tempfile.TemporaryDirectory(prefix="surgeon-upgrade-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(fragment), encoding="utf-8")
        yield Path(tmp)


def _errors(report: DraftReport) -> list[str]:
    return [f.detail for f in report.findings if f.severity == "error"]


def _unverified(report: DraftReport) -> list[str]:
    return [f.detail for f in report.findings if f.kind == "unverified"]


def verdict(was: DraftReport, now: DraftReport, old: Release, new: Release) -> tuple[Served, list[str]]:
    """The deployed config on the new release (``now``) against the old (``was``): differently where
    the new one captures other points and the old served the spec's, both read to the end;
    undecided where either rests on code not read."""
    e_old, e_new = _errors(was), _errors(now)
    u_old, u_new = _unverified(was), _unverified(now)
    said_old = [f"{old.engine} {old.version}: {d}" for d in e_old + u_old]
    said_new = [f"{new.engine} {new.version}: {d}" for d in e_new + u_new]
    if e_new and not e_old and not u_old:
        return "differently", said_new
    if e_new or u_new:
        return "undecided", said_new + said_old
    if e_old:  # the old release did not serve its own rendering as the spec says; the new one does
        return "undecided", said_old
    return "same", []


def _without_class(probe: EngineProbe, model_class: str, new: Release, why: str) -> tuple[Served, list[str]]:
    """The new release cannot answer for the class: gone, or shown unable to capture, is a draft
    served differently (it is not served at all); a class the probe cannot read is undecided."""
    cc = probe.get(model_class)
    gone = cc is None or cc.no_capture
    return ("differently" if gone else "undecided"), [f"{new.engine} {new.version}: {why}"]


# ---------------------------------------------------------------------------------------------
# model classes: what each class's ids mean, before and after
# ---------------------------------------------------------------------------------------------
def class_changes(old: EngineProbe, new: EngineProbe, spec_classes: Sequence[str] = ()) -> list[ClassDiff]:
    """Every class whose meaning changed: the specs' classes (by name or registered architecture)
    first, then every other class either probe found, matched by file and name (a class whose
    name is unique on both sides is followed to another file)."""
    out: list[ClassDiff] = []
    done: set[int] = set()
    for name in spec_classes:
        a, b = old.get(name), new.get(name)
        done.update(id(c) for c in (a, b) if c is not None)
        changes = compare_class(name, a, b)
        if changes:
            out.append(ClassDiff(name, True, changes))
    names = Counter(c.class_name for c in old.classes.values()) | Counter(c.class_name for c in new.classes.values())
    for a, b in class_pairs(old, new):
        if id(a) in done or id(b) in done:
            continue
        either = b or a
        assert either is not None  # a pair holds at least one class
        label = either.class_name if names[either.class_name] == 1 else f"{either.path}:{either.class_name}"
        changes = compare_class(label, a, b)
        if changes:
            out.append(ClassDiff(label, False, changes))
    return sorted(out, key=lambda d: (not d.in_specs, "" if d.in_specs else d.class_name))


Pair = tuple[ClassConvention | None, ClassConvention | None]


def class_pairs(old: EngineProbe, new: EngineProbe) -> list[Pair]:
    """The classes of both probes paired: by (file, name), then the rest by a name that is unique
    among the unpaired of each side (a class that moved to another file); the others alone."""
    a = {(c.path, c.class_name): c for c in old.classes.values()}
    b = {(c.path, c.class_name): c for c in new.classes.values()}
    pairs: list[Pair] = [(a[k], b[k]) for k in a if k in b]
    left = [a[k] for k in a if k not in b]
    right = [b[k] for k in b if k not in a]
    once_a, once_b = _unique(left), _unique(right)
    moved = {name: once_b[name] for name in once_a if name in once_b}
    pairs += [(c, moved.get(c.class_name) if c.class_name in once_a else None) for c in left]
    taken = {id(c) for c in moved.values()}
    pairs += [(None, c) for c in right if id(c) not in taken]
    return pairs


def _unique(classes: list[ClassConvention]) -> dict[str, ClassConvention]:
    """The classes whose name occurs once in ``classes``, by name."""
    counts = Counter(c.class_name for c in classes)
    return {c.class_name: c for c in classes if counts[c.class_name] == 1}


def _at(cc: ClassConvention) -> list[str]:
    return [f"{cc.path}:{cc.line}"]


def _status_text(cc: ClassConvention) -> str:
    if cc.status == "classified":
        return "classified"
    kind = ("no capture" if cc.no_capture else "delegates its ids to a text model" if cc.delegates
            else "the probe cannot tell what its ids mean")
    return f"unclassified ({kind})"


def compare_class(key: str, a: ClassConvention | None, b: ClassConvention | None) -> list[Change]:
    """What differs in ``key``'s meaning between the old (``a``) and new (``b``) reading."""
    if a is None or b is None:
        return [Change(key, "class", _presence(a), _presence(b), _at(a) if a else [], _at(b) if b else [])]
    if _status_text(a) != _status_text(b):
        return [Change(key, "status", _with_reason(a), _with_reason(b), _at(a), _at(b))]
    if a.status != "classified":
        return []
    found = (_aspect(key, "id rule", a, b, _rule_text, _setter_at), _aspect(key, "default", a, b, _default_text, _default_at),
             _aspect(key, "order", a, b, _order_text, _order_at), _aspect(key, "capture sites", a, b, _sites_text, _sites_at),
             _aspect(key, "verified", a, b, _verified_text, _unverified_at))
    return [c for c in found if c is not None]


def _presence(cc: ClassConvention | None) -> str | None:
    return None if cc is None else f"{cc.class_name}, {_status_text(cc)}"


def _with_reason(cc: ClassConvention) -> str:
    return _status_text(cc) + (f": {cc.reason}" if cc.status != "classified" and cc.reason else "")


def _aspect(key: str, aspect: str, a: ClassConvention, b: ClassConvention, text: Callable[[ClassConvention], str],
            at: Callable[[ClassConvention], list[str]]) -> Change | None:
    ta, tb = text(a), text(b)
    if _unplaced(ta) == _unplaced(tb):
        return None
    return Change(key, aspect, ta, tb, at(a), at(b))


def _evidence_at(cc: ClassConvention, *roles: str) -> list[str]:
    return list(dict.fromkeys(f"{e.path}:{e.line}" for e in cc.evidence if e.role in roles))


def _rule_text(cc: ClassConvention) -> str:
    return f"{cc.setter or 'setter'}: {cc.id_rule.name if cc.id_rule else 'no rule'}"


def _setter_at(cc: ClassConvention) -> list[str]:
    return _evidence_at(cc, "setter") or _at(cc)


def _default_text(cc: ClassConvention) -> str:
    if cc.default is None:
        return "none (the setter needs ids)"
    how = "through the id rule" if cc.default_through_rule else "as capture indices"
    return f"[{', '.join(str(t) for t in cc.default)}] {how}"


def _default_at(cc: ClassConvention) -> list[str]:
    return _evidence_at(cc, "default") or _setter_at(cc)


def _order_text(cc: ClassConvention) -> str:
    words = (["sorts"] if cc.sorts else []) + (["de-duplicates"] if cc.dedups else [])
    return ", ".join([*words, f"emits in {cc.emit_order} order"])


def _order_at(cc: ClassConvention) -> list[str]:
    return _evidence_at(cc, "setter", "loop") or _at(cc)


def _sites_text(cc: ClassConvention) -> str:
    if not cc.sites:
        return f"{cc.capture_site} capture of {cc.captured_value}" + (", and after the loop" if cc.tail_capture else "")
    texts = sorted(f"{s.where}: {s.value}: {s.expression} in {s.path}"
                   + (" (cannot be evaluated at its first index)" if s.first_index_fails else "") for s in cc.sites)
    return "; ".join(texts)


def _sites_at(cc: ClassConvention) -> list[str]:
    return list(dict.fromkeys(f"{s.path}:{s.line}" for s in cc.sites)) or _evidence_at(cc, "loop") or _at(cc)


def _verified_text(cc: ClassConvention) -> str:
    return "verified" if cc.verified else f"unverified: {cc.unverified_reason or 'not read'}"


def _unverified_at(cc: ClassConvention) -> list[str]:
    return [f"{s.path}:{s.line}" for s in cc.sites if not s.verified] or _at(cc)


# ---------------------------------------------------------------------------------------------
# the model runner: which setter calls, and which draft-config keys they read
# ---------------------------------------------------------------------------------------------
def runner_changes(old: RunnerModel | None, new: RunnerModel | None) -> list[Change]:
    """What the release's model runner hands the setter, before and after: its verdict, each setter
    call (by the function holding it and the setter), and each draft-config key read."""
    out = [c for c in (_runner_verdict(old, new),) if c is not None]
    out.extend(_call_changes(old.calls if old else (), new.calls if new else ()))
    out.extend(_key_changes(old.calls if old else (), new.calls if new else ()))
    return out


def _verdict_text(runner: RunnerModel | None) -> str:
    if runner is None:
        return "not read"
    if runner.ignores_draft_ids:
        return "ignores the draft's ids: always the model's default"
    return (runner.reason or "not verified") if not runner.verified else "passes the draft config's ids"


def _runner_verdict(old: RunnerModel | None, new: RunnerModel | None) -> Change | None:
    a, b = _verdict_text(old), _verdict_text(new)
    if _unplaced(a) == _unplaced(b):
        return None
    return Change("runner", "verdict", a, b, [c.where for c in old.calls] if old else [],
                  [c.where for c in new.calls] if new else [])


def _call_text(call: RunnerCall) -> str:
    reads = ", ".join(_key_label(s.key, s.offset) + ("" if s.origin == "draft_config" else " (engine)")
                      for s in call.sources)
    text = f"{call.function} calls {call.setter}: {call.passes}"
    text += f", reading {reads}" if reads else ""
    text += f", else {call.default_method}()" if call.default_method else ""
    return text + (f" ({call.detail})" if call.detail and call.passes in ("passed_in", "unknown") else "")


def _call_at(call: RunnerCall) -> list[str]:
    return list(dict.fromkeys([call.where, *(f"{s.path}:{s.line}" for s in call.sources)]))


def _call_changes(old: Sequence[RunnerCall], new: Sequence[RunnerCall]) -> Iterator[Change]:
    a = {(c.function, c.setter): c for c in old}
    b = {(c.function, c.setter): c for c in new}
    for key in list(a) + [k for k in b if k not in a]:
        ca, cb = a.get(key), b.get(key)
        ta, tb = (_call_text(ca) if ca else None), (_call_text(cb) if cb else None)
        if ta is not None and tb is not None and _unplaced(ta) == _unplaced(tb):
            continue
        yield Change("runner", "setter call", ta, tb, _call_at(ca) if ca else [], _call_at(cb) if cb else [])


def _key_label(key: str, offset: int) -> str:
    return key + (f" {offset:+d}" if offset else "")


def _keys(calls: Sequence[RunnerCall]) -> dict[str, list[str]]:
    """Each draft-config key read (with its offset) -> file:line of each read."""
    out: dict[str, list[str]] = {}
    for c in calls:
        for s in c.sources:
            if s.origin == "draft_config":
                out.setdefault(_key_label(s.key, s.offset), []).append(f"{s.path}:{s.line}")
    return out


def _key_changes(old: Sequence[RunnerCall], new: Sequence[RunnerCall]) -> Iterator[Change]:
    a, b = _keys(old), _keys(new)
    for key in [k for k in a if k not in b]:
        yield Change("runner", "draft-config key", key, None, a[key], [])
    for key in [k for k in b if k not in a]:
        yield Change("runner", "draft-config key", None, key, [], b[key])
