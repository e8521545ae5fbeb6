"""Engine pins: the ids and offset a deployment relies on, written in the spec and checked against
the installed engine, so a release that changes a convention fails `surgeon lint` in CI instead of
shifting every capture by one layer in production (sgl-project/sglang#25454).

``engines.<e>`` in a spec holds ``version`` (PEP 440 range), ``model_file``, ``model_class``,
``ids`` (what the deployment passes) and ``offset`` (the probe's name for the class's id rule).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from surgeon.core.atomicfile import atomic_write
from surgeon.core.conventions import EngineConvention, OffsetError, builtin_convention, parse_offset
from surgeon.core.errors import BadInput
from surgeon.core.idrules import ClassConvention
from surgeon.core.spec import Issue, Spec, load_spec
from surgeon.engines.view import EngineView, model_class_for, open_engine


def _slot_diffs(spec: Spec, captured: list) -> list[str]:
    out = []
    expected = spec.fc_points
    for i, name in enumerate(spec.fc_names):
        got = captured[i] if i < len(captured) else None
        if got != expected[i]:
            out.append(f"'{name}' (fc slot {i}, {expected[i]}) would be {got if got is not None else 'not captured'}")
    if len(captured) > len(expected):
        extra = ", ".join(str(c) if c is not None else "an index the loop never reaches" for c in captured[len(expected):])
        out.append(f"{len(captured) - len(expected)} extra capture(s): {extra}")
    return out


def _sglang_dflash(spec: Spec, engine: str) -> bool:
    return engine == "sglang" and spec.model.draft is not None and spec.model.draft.kind == "dflash"


def pinned_class_convention(spec: Spec, engine: str, view: EngineView, cls: str | None) -> ClassConvention:
    """The class's convention for the setter the spec's draft goes through: an SGLang DFlash draft's
    ids go to the class's ``set_dflash_layers_to_capture``
    (:func:`surgeon.engines.facts.sglang_dflash.classify_dflash`), every other draft's to the EAGLE-3
    setter the probe reads; the two are separate methods and may differ."""
    if not _sglang_dflash(spec, engine) or view.location is None:
        return view.class_convention(cls)
    from surgeon.engines.facts.sglang_dflash import SETTER, classify_dflash

    where = f"{engine} {view.version}"
    cc = classify_dflash(view.location.root, cls) if cls is not None else None
    if cc is None:
        raise BadInput(f"{where} has no class {cls!r} with {SETTER}")
    if cc.status != "classified":
        raise BadInput(f"{where} {cc.class_name} ({cc.path}:{cc.line}): the probe cannot tell what its DFlash ids "
                       f"mean: {cc.reason}")
    return cc


def check_pins(spec: Spec, engine: str, view: EngineView | None = None) -> tuple[list[Issue], list[str]]:
    """(issues, what was checked). Without the engine installed, pins are checked for consistency
    with the spec only, and the returned notes say the engine check did not run."""
    pin = spec.pin(engine)
    if pin is None:
        return [], []
    issues: list[Issue] = []
    checked: list[str] = []
    base = ("engines", engine)
    cls = model_class_for(spec, engine)

    # 1. consistency with the spec alone: the pinned ids through the pinned offset
    pinned_rule = None
    if pin.offset is not None:
        try:
            pinned_rule = parse_offset(pin.offset)
        except OffsetError as e:
            issues.append(spec.issue(base + ("offset",), str(e)))
    if pin.ids is not None and spec.model.draft is not None and pinned_rule is not None:
        family = builtin_convention(engine, cls)
        conv = EngineConvention(replace(family, id_rule=pinned_rule), "pins")
        captured = conv.decode(pin.ids, spec.num_layers)
        diffs = _slot_diffs(spec, captured)
        if diffs:
            issues.append(spec.issue(
                base + ("ids",),
                f"pinned ids {pin.ids} with offset '{pin.offset}' do not capture the spec's fc input: " + "; ".join(diffs),
            ))
        else:
            checked.append(f"{engine}: pinned ids {pin.ids} with offset '{pin.offset}' capture the spec's fc input")

    # 2. against the installed engine
    view = view or open_engine(engine)
    if view.probe is None:
        checked.append(
            f"{engine}: engine check did not run: {engine} is not installed (pass --engine-root to check against a copy)"
        )
        return issues, checked
    version = view.probe.version
    where = f"{engine} {version}"
    if pin.version is not None:
        try:
            inside = Version(version) in SpecifierSet(pin.version)
        except InvalidVersion:
            inside = False
        if not inside:
            issues.append(spec.issue(
                base + ("version",),
                f"installed {where} is outside the pinned range '{pin.version}': "
                f"check the convention again and re-pin (surgeon render --engine {engine} --pin)",
            ))
            return issues, checked
    try:
        cc = pinned_class_convention(spec, engine, view, cls)
    except BadInput as e:
        issues.append(spec.issue(base + ("model_class",), str(e)))
        return issues, checked
    if pin.model_file is not None and pin.model_file != cc.path:
        issues.append(spec.issue(base + ("model_file",), f"{where}: {cls} is defined in {cc.path}, not {pin.model_file}"))
    actual = cc.id_rule.name if cc.id_rule else "?"
    setter = ", its DFlash setter" if _sglang_dflash(spec, engine) else ""
    if pinned_rule is not None and pinned_rule.name != actual:
        issues.append(spec.issue(
            base + ("offset",),
            f"{where} {cls} ({cc.setter_owner}{setter}) turns ids into capture indices by '{actual}', "
            f"the pin says '{pinned_rule.name}'",
        ))
    if pin.ids is not None and spec.model.draft is not None:
        conv = EngineConvention(cc, view.origin)
        captured = conv.decode(pin.ids, spec.num_layers)
        diffs = _slot_diffs(spec, captured)
        if diffs:
            issues.append(spec.issue(
                base + ("ids",),
                f"{where} {cls}: pinned ids {pin.ids} no longer capture the spec's fc input: " + "; ".join(diffs),
            ))
        else:
            checked.append(f"{engine}: pinned ids {pin.ids} capture the spec's fc input on {where} {cls}{setter} "
                           f"(offset '{actual}')")
    return issues, checked


def pin_values(spec: Spec, engine: str, *, engine_root=None, model_class: str | None = None) -> dict:
    """The pins for the installed engine: what `surgeon render --pin` writes."""
    from surgeon.wiring.render import fc_ids

    view = open_engine(engine, engine_root)
    if view.probe is None:
        raise BadInput(f"cannot pin {engine}: it is not installed here (pass --engine-root)")
    cls = model_class_for(spec, engine, model_class)
    cc = pinned_class_convention(spec, engine, view, cls)
    if _sglang_dflash(spec, engine):
        from surgeon.wiring.render import sglang_dflash

        ids = list(sglang_dflash(spec, engine_root, model_class).ids)
    else:
        lst = fc_ids(spec, engine, engine_root=engine_root, model_class=model_class, view=view)
        if lst.ids is None:
            raise BadInput(f"{spec.file}: cannot pin {engine}: {lst.error}")
        ids = list(lst.ids)
    assert cc.id_rule is not None  # fc_ids just encoded through this class's rule
    return {"version": f"=={view.probe.version}", "model_file": cc.path, "model_class": cls,
            "ids": ids, "offset": cc.id_rule.name}


def write_pins(spec_path: str | Path, engine: str, values: dict) -> None:
    """Write ``engines.<engine>`` into the spec file, keeping its comments, order and quoting
    (ruamel.yaml round trip), atomically; the result is validated before it replaces the file."""
    from io import StringIO

    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    path = Path(spec_path)
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096
    text = path.read_text(encoding="utf-8")
    doc = yaml.load(text)
    engines = doc.get("engines")
    if engines is None:
        engines = CommentedMap()
        doc["engines"] = engines
    pin = engines.get(engine)
    if pin is None:
        pin = CommentedMap()
        pin.fa.set_flow_style()
        engines[engine] = pin
    for key, value in values.items():
        if isinstance(value, list):
            seq = CommentedSeq(value)
            seq.fa.set_flow_style()
            value = seq
        pin[key] = value
    buf = StringIO()
    yaml.dump(doc, buf)
    new_text = buf.getvalue()
    load_spec(path, text=new_text)  # refuse to write a spec that does not load
    atomic_write(path, new_text.encode("utf-8"), mode=path.stat().st_mode & 0o7777)
