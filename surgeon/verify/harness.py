"""The wiring harness: read a subject, get a reference, align tokens, identify every slot, and say
what to change. `surgeon match`, `surgeon verify`, `surgeon fingerprint` and the pytest plugin are
thin shells over :func:`match`.

References are ``hf:DIR`` (an HF model folder, run here on the subject's input ids), a reference
file written by ``surgeon reference`` / :func:`surgeon.verify.reference.save_reference`, or a fingerprint
file (:mod:`surgeon.verify.fingerprint`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from surgeon.capture.tensorfiles import open_tensor_file
from surgeon.core.conventions import EAGLE, NotExpressible
from surgeon.core.errors import UNDECIDED as UNDECIDED_EXIT
from surgeon.core.errors import BadInput
from surgeon.core.points import Point
from surgeon.core.spec import Spec
from surgeon.verify.fielddumps import split_producer
from surgeon.verify.identify import UNDECIDED
from surgeon.verify.subjects import Subject, align, read_subject


def parse_input_ids(text: str | None) -> torch.Tensor | None:
    if text is None:
        return None
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise BadInput(f"--input-ids {text[:40]!r}: expected integers separated by commas or spaces") from None
    if not ids:
        raise BadInput("--input-ids is empty")
    return torch.tensor(ids, dtype=torch.int64)


def load_reference_arg(ref: str, input_ids: torch.Tensor | None):
    """A Reference or a Fingerprint from a ``--reference`` argument."""
    if ref.startswith("hf:"):
        from surgeon.verify.reference import capture_reference

        if input_ids is None:
            raise BadInput("an hf: reference needs input ids: the subject carries none, so pass --input-ids")
        return capture_reference(ref[3:], input_ids)
    path = Path(ref)
    if path.is_dir() or not os.path.lexists(path):
        raise BadInput(f"--reference {ref}: {'a directory' if path.is_dir() else 'no such file'} (use hf:DIR for a model folder)")
    kind = open_tensor_file(path).kind  # the gate: a regular file with a sane header, before any read
    if kind == "reference":
        from surgeon.verify.reference import load_reference

        return load_reference(path)
    if kind == "fingerprint":
        from surgeon.verify.fingerprint import load_fingerprint

        return load_fingerprint(path)
    if kind == "dump":  # an engine's sweep (every point captured): a reference where HF cannot run
        from surgeon.capture.dumps import read_dump
        from surgeon.verify.reference import Reference

        d = read_dump(path)
        return Reference(states={p: t.float() for _, p, t in d.captures}, input_ids=d.input_ids,
                         num_layers=d.num_layers, hidden_size=d.hidden_size,
                         source=f"{d.meta.get('engine') or 'dump'}:{path}")
    raise BadInput(f"--reference {ref}: not a surgeon reference or fingerprint file (surgeon.kind is {kind!r})")


def _slice_reference(ref, window: slice):
    from surgeon.verify.fingerprint import Fingerprint

    if window == slice(None):
        return ref
    if isinstance(ref, Fingerprint):
        return replace(ref, input_ids=ref.input_ids[window], proj={k: v[window] for k, v in ref.proj.items()},
                       norms={k: v[window] for k, v in ref.norms.items()}, first={k: v[window] for k, v in ref.first.items()})
    return replace(ref, input_ids=ref.input_ids[window], states={k: v[window] for k, v in ref.states.items()})


@dataclass(frozen=True)
class Suggestion:
    """What to change: each slot's matched point, and each engine's ids for those points (or why none)."""

    captures: dict[str, Point]  # slot name -> the point it holds
    engine_ids: dict[str, Any]  # engine -> ids for the corrected captures, or why none


@dataclass
class HarnessResult:
    """A subject's slots identified against a reference. ``match --json`` and ``verify --json``
    print it through :class:`surgeon.commands.outputs.harness.MatchResult`, which reads the
    attributes and properties below by its field names."""

    subject: Subject
    reference_source: str
    alignment: str
    report: Any  # surgeon.verify.identify.MatchReport
    num_layers: int
    engine_ids: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing wrong and nothing undecided: the exit status is 0."""
        return self.verdict in ("ok", "identified")

    @property
    def verdict(self) -> str:
        """``mismatch`` (a slot is not its declared point, or matches no point), ``undecided`` (else,
        a slot the reference cannot tell apart from another point), ``identified`` (every slot
        matched one point, none declared), or ``ok`` (every declared slot is its declared point)."""
        kinds = {s.verdict for s in self.report.slots}
        if kinds & {"mismatch", "no_match"} or self.subject.missing:
            return "mismatch"
        if UNDECIDED in kinds:
            return "undecided"
        return "identified" if kinds <= {"unlabelled"} else "ok"

    @property
    def exit_code(self) -> int:
        """3 mismatch, 4 undecided, else 0 (match and verify alike)."""
        return {"mismatch": 3, "undecided": UNDECIDED_EXIT}.get(self.verdict, 0)

    @property
    def slots(self) -> list[Any]:
        """Each slot's identification (:class:`surgeon.verify.identify.SlotResult`)."""
        return list(self.report.slots)

    @property
    def diagnosis(self) -> list[Any]:
        """What went wrong (:class:`surgeon.verify.identify.Diagnosis`), the explanation covering the
        most slots first."""
        return list(self.report.diagnosis)

    @property
    def missing(self) -> list[str]:
        """The spec's dump slots (``name: point``) at points no slot's record gives: a mismatch."""
        return list(self.subject.missing)

    @property
    def suggested(self) -> Suggestion:
        return Suggestion(self.report.suggested_captures, self.engine_ids)

    @property
    def layout(self) -> str:
        """The subject's layout (``surgeon``, ``trtllm``, ``specforge``, ...)."""
        return self.subject.layout

    @property
    def reference(self) -> str:
        """Where the reference came from (its :attr:`reference_source`)."""
        return self.reference_source

    @property
    def headline(self) -> str:
        """The first line of the report: the verdict, and which slots it rests on."""
        slots = self.report.slots
        n = len(slots)

        def names(*verdicts: str) -> list[str]:
            return [s.name for s in slots if s.verdict in verdicts]

        bad, open_, ok, free = names("mismatch", "no_match"), names(UNDECIDED), names("ok"), names("unlabelled")
        parts = []
        if self.subject.missing:
            parts.append(f"the spec's {'; '.join(self.subject.missing)} in no slot the file records")
        if bad:
            parts.append(f"{len(bad)} of {n} slot{'s' if n > 1 else ''} not what {'was' if len(bad) == 1 else 'were'} "
                         f"declared or matching no point ({', '.join(bad)})")
        if open_:
            parts.append(f"{len(open_)} of {n} undecided: the reference cannot tell the points they fit apart "
                         f"({', '.join(open_)})")
        if ok:
            parts.append(f"{len(ok)} of {n} {'is its' if len(ok) == 1 else 'are their'} declared point"
                         + ("" if len(ok) == 1 else "s"))
        if free:
            parts.append(f"{len(free)} of {n} declared nothing and matched one point ({', '.join(free)})")
        return f"{self.verdict}: " + "; ".join(parts)


def _declare_from_spec(subject: Subject, spec: Spec, slots_given: bool, by_producer: bool) -> list[str]:
    """Label the subject's slots with the spec's points: by name where the file names its tensors
    (whatever order it stores them in); by point where every slot's point is recorded (the file, the
    record beside it, or ``--slots PRODUCER:IDS``); by the layout's own order otherwise
    (:meth:`Spec.slot_order`); by the names ``--slots`` gave."""
    if subject.keyed and not slots_given:
        names, notes = _keyed_names(subject, spec)
    elif (by_producer or not slots_given) and subject.slots and all(d is not None for _, d, _ in subject.slots):
        names, notes = _by_recorded_point(subject, spec)
    elif slots_given:
        names, notes = subject.names, []
    else:
        order, how = spec.slot_order(subject.layout)
        if len(order) != len(subject.names):
            raise BadInput(f"{subject.source} holds {len(subject.names)} slots, the spec's dump slots are {len(order)} "
                           f"({', '.join(order)}): pass --slots")
        names, notes = order, [f"slots named from the spec in {how} order: {', '.join(order)}"]
    slots, differ = [], []
    for (old, declared, t), name in zip(subject.slots, names):
        if name in spec.captures and declared is not None and declared != spec.captures[name]:
            differ.append(f"{old}: {declared} -> {name}: {spec.captures[name]}")
        slots.append((name, spec.captures.get(name, declared), t))
    subject.slots = slots
    if differ:  # labelled otherwise by the file or --slots: say so; the spec is what is checked
        notes.append("the spec's labels replace the subject's own: " + "; ".join(differ))
    if not subject.missing and not any(n in spec.captures for n in names):
        raise BadInput(f"{subject.source}: no slot is named for a capture of spec {spec.name} "
                       f"({', '.join(spec.dump_slots)}): name them with --slots NAME=KEY or NAME=POINT")
    return notes


def _by_recorded_point(subject: Subject, spec: Spec) -> tuple[list[str], list[str]]:
    """Every slot's point is recorded: the spec's dump slots are the slots recorded at their
    points; a dump slot whose point no slot records is a mismatch the record itself shows."""
    by_point = {d: i for i, (_, d, _) in enumerate(subject.slots)}
    order = spec.dump_slots
    missing = [f"{n}: {spec.captures[n]}" for n in order if spec.captures[n] not in by_point]
    if missing:  # each slot is still identified against what its record says; the spec's absence is the mismatch
        subject.missing = missing
        return subject.names, [f"the file records its slots as {', '.join(str(d) for _, d, _ in subject.slots)}: "
                               f"none holds the spec's {'; '.join(missing)}"]
    picked = [by_point[spec.captures[n]] for n in order]
    extra = [name for i, name in enumerate(subject.names) if i not in picked]
    subject.slots = [subject.slots[i] for i in picked]
    notes = [f"the spec's dump slots found at the points the file's record gives ({', '.join(order)})"]
    if extra:
        notes.append(f"slots not among the spec's dump slots, left out: {', '.join(extra)}")
    return list(order), notes


def _keyed_names(subject: Subject, spec: Spec) -> tuple[list[str], list[str]]:
    """A file that names its tensors, labelled by the spec: the keys that are the spec's dump slots,
    each by its name; other keys left out (said); a dump slot the file lacks refused."""
    order = spec.dump_slots
    keys = subject.names
    present = [n for n in order if n in keys]
    if not present:
        by_point = {d: i for i, (_, d, _) in enumerate(subject.slots) if d is not None}
        if all(spec.captures[n] in by_point for n in order):  # keys that name the spec's points
            picked = [by_point[spec.captures[n]] for n in order]
            subject.slots = [subject.slots[i] for i in picked]
            return list(order), [f"slots found by the points their keys name ({', '.join(keys[i] for i in picked)})"]
        if all(d is not None for _, d, _ in subject.slots) and subject.layout == "surgeon-reference":
            return keys, ["no tensor is named as a capture of the spec: the reference's own points are checked"]
        raise BadInput(f"{subject.source}: its tensors are named {', '.join(keys)}, none of them a dump slot of spec "
                       f"{spec.name} ({', '.join(order)}): name them with --slots NAME=KEY")
    missing = [n for n in order if n not in keys]
    if missing:
        raise BadInput(f"{subject.source}: no tensor named {', '.join(repr(m) for m in missing)} (the spec's dump slots: "
                       f"{', '.join(order)}; the file's: {', '.join(keys)}): pass --slots to choose the keys to check")
    index = {k: i for i, k in enumerate(keys)}
    subject.slots = [subject.slots[index[n]] for n in order]
    notes = [f"slots read by name ({', '.join(order)}), not by their order in the file"]
    extra = [k for k in keys if k not in order]
    if extra:
        notes.append(f"tensors not among the spec's dump slots, left out: {', '.join(extra)}")
    return list(order), notes


def suggested_engine_ids(spec: Spec, captures: dict[str, Point]) -> dict[str, Any]:
    """Each engine's ids for the corrected fc input (the spec's fc names, with matched points)."""
    from surgeon.engines.view import model_class_for, open_engine

    if spec.model.draft is None:
        return {}
    points = [captures.get(n, spec.captures[n]) for n in spec.fc_names]
    out: dict[str, Any] = {}
    for engine in ("sglang", "vllm"):
        try:
            conv = open_engine(engine).convention(model_class_for(spec, engine))
            out[engine] = conv.encode(points, spec.num_layers)
        except NotExpressible as e:  # its message names the convention, the point and why
            out[engine] = str(e)
        except BadInput as e:
            out[engine] = f"refused: {e}"
    try:
        out["eagle"] = EAGLE.encode(points, spec.num_layers)
    except NotExpressible as e:
        out["eagle"] = str(e)
    return out


def match(subject_path: str | Path, reference: str, *, spec: Spec | None = None, slots: Sequence[str] = (),
          input_ids: str | None = None) -> HarnessResult:
    from surgeon.verify.identify import identify

    L = spec.num_layers if spec else None
    subject = read_subject(subject_path, slots=slots, num_layers=L, spec=spec)
    notes = list(subject.notes)
    if spec is not None:
        producer, _ = split_producer(slots)
        notes += _declare_from_spec(subject, spec, bool(slots), producer is not None)
    ids = parse_input_ids(input_ids)
    if ids is not None:
        n_tokens = subject.slots[0][2].shape[0]
        if subject.input_ids is not None and not torch.equal(subject.input_ids, ids):
            raise BadInput("--input-ids differ from the input ids the subject carries")
        if ids.numel() != n_tokens:
            raise BadInput(f"--input-ids has {ids.numel()} ids for {n_tokens} tokens")
        subject.input_ids = ids
    ref = load_reference_arg(reference, subject.input_ids)
    n_tokens = subject.slots[0][2].shape[0]
    s_window, r_window, how = align(subject.input_ids, ref.input_ids, n_tokens)
    ref = _slice_reference(ref, r_window)
    slot_list = [(n, d, t[s_window]) for n, d, t in subject.slots]
    width = slot_list[0][2].shape[1]
    if width != ref.hidden_size:
        raise BadInput(f"subject hidden size {width} differs from the reference's {ref.hidden_size}: different models")
    if spec is not None and spec.num_layers != ref.num_layers:
        raise BadInput(f"the spec's target has {spec.num_layers} layers, the reference {ref.num_layers}")
    report = identify(slot_list, ref, num_layers=ref.num_layers)
    result = HarnessResult(subject, getattr(ref, "source", reference), how, report, ref.num_layers, notes=notes)
    if spec is not None:
        result.engine_ids = suggested_engine_ids(spec, report.suggested_captures)
    return result


def plot_heatmap(result: HarnessResult, path: str | Path) -> Path:
    """Slots x candidate points, colour = log10 relative error; declared points boxed, matches
    dotted, exact matches starred. The wrong wiring is visible at a glance: a slot's dark cell sits
    off its box."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = heatmap_figure(result)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def heatmap_figure(result: HarnessResult):
    """The heatmap as a matplotlib figure (:func:`plot_heatmap` saves it)."""
    import matplotlib.pyplot as plt

    rep = result.report
    errs = rep.errors.float().clamp_min(1e-6).log10().numpy()
    cands = [str(c) for c in rep.candidates]
    fig_w = max(8.0, 0.12 * len(cands) + 3)
    fig, ax = plt.subplots(figsize=(fig_w, 1.9 + 0.55 * len(rep.slots)))
    im = ax.imshow(errs, aspect="auto", cmap="viridis_r", vmin=-3, vmax=0.3, interpolation="nearest")
    step = max(1, len(cands) // 40)
    ax.set_xticks(range(0, len(cands), step))
    ax.set_xticklabels(cands[::step], rotation=90, fontsize=7)
    ax.set_yticks(range(len(rep.slots)))
    ax.set_yticklabels([f"{s.name} ({s.declared or '?'})" for s in rep.slots], fontsize=8)
    ax.set_xlabel("reference point, in forward-pass order (layer_delta[k]: layer k without the residual)", fontsize=8)
    ax.set_ylabel("subject slot (declared point)", fontsize=8)
    for i, s in enumerate(rep.slots):
        if s.declared is not None and str(s.declared) in cands:
            j = cands.index(str(s.declared))
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
        if s.matched is not None:
            j = cands.index(str(s.matched))
            if s.exact:
                ax.plot(j, i, marker="*", color="white", markeredgecolor="black", markersize=11, linestyle="none",
                        label="exact")
            else:
                ax.plot(j, i, "w.", markersize=6, label="matched")
    ax.set_title(f"{Path(result.subject.source).name} vs {Path(str(result.reference_source)).name}: "
                 "log10 relative error (red box: declared, white dot: matched, star: exact match)", fontsize=9)
    bar = fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01)
    bar.set_label("log10 relative error", fontsize=8)
    fig.tight_layout()
    return fig
