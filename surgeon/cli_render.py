"""Text renderings of the command results for the terminal (rich tables and lines); ``--json``
prints the result through its output model instead (:mod:`surgeon.commands.outputs`). Rendering
only: every decision was made by the command."""
from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from surgeon.commands.outputs import AuditOutput, InferWiringOutput, output_of
from surgeon.commands.progress import HEARTBEAT_S, Heartbeat
from surgeon.core.errors import InternalError

if TYPE_CHECKING:
    from surgeon.audit.pipeline import AuditReport
    from surgeon.commands.capture_commands import DumpInfo, HookCheck
    from surgeon.commands.demo_command import DemoReport
    from surgeon.commands.patch_commands import DoctorReport, RevertReport, StatusReport
    from surgeon.commands.results import GeneratedText
    from surgeon.commands.spec_commands import LintReport
    from surgeon.core.idrules import EngineProbe
    from surgeon.draft.accept import AcceptReport
    from surgeon.draft.infer import InferReport
    from surgeon.patch.apply import ApplyOutcome
    from surgeon.patch.coverage import CoverageReport
    from surgeon.patch.routes import Plan
    from surgeon.verify.harness import HarnessResult
    from surgeon.wiring.draft import DraftReport
    from surgeon.wiring.render import Explanation, Rendering
    from surgeon.wiring.upgrade import Change, SpecUpgrade, UpgradeReport

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
if not out.is_terminal:  # piped into a file or a CI log: do not wrap tables at 80 columns
    out = Console(highlight=False, soft_wrap=True, width=200)


# --------------------------------------------------------------------------------------------- plumbing
def emit_json(data: Any) -> None:
    """Print ``data`` as JSON. The rule that every number printed is finite is enforced, with the
    path of the offending number, by :func:`surgeon.commands.outputs.base.non_finite` in
    ``json_output``, which every result passes; ``allow_nan=False`` here is only the last-resort
    assertion behind it (it costs nothing, and it also covers what does not pass ``json_output``:
    the schema), so a broken promise is an internal error, never a bare ``NaN`` that is not JSON."""
    try:
        text = json.dumps(data, indent=2, sort_keys=False, default=str, allow_nan=False)
    except ValueError as e:  # a non-finite float (json_output's guard bypassed) or a cycle: a bug either way
        raise InternalError(f"the --json output cannot be printed as JSON ({e}); surgeon prints no NaN or "
                            "Infinity") from None
    click.echo(text)


class _RateColumn(ProgressColumn):
    """Items per second, once rich has measured it (the throughput of an audit, a probe)."""

    def render(self, task: Any) -> Text:
        return Text(f"{task.speed:.1f}/s" if task.speed else "", style="dim")


class RichProgress:
    """The commands' progress on stderr, each step with its elapsed time: on a terminal a live bar
    (probes, HF runs) or spinner (the rest), cleared when the step ends. Nothing under ``--json``
    for the commands that ask so, and nothing in a log, where a command's stderr is its problem
    lines only (the demo, minutes long, keeps a log alive with :func:`demo_display`)."""

    def __init__(self, as_json: bool = False, console: Console | None = None):
        self.as_json = as_json
        self.console = console or err

    @contextlib.contextmanager
    def _live(self, label: str, *columns: Any) -> Iterator[Callable[..., None]]:
        if self.as_json or not self.console.is_terminal:
            yield lambda **kw: None
        else:
            with Progress(SpinnerColumn(), TextColumn(escape(label)), *columns, TimeElapsedColumn(),
                          console=self.console, transient=True) as live:
                task = live.add_task(label, total=None)
                yield lambda **kw: live.update(task, **kw)

    @contextlib.contextmanager
    def bar(self, label: str) -> Iterator[Callable[[int, int], None]]:
        with self._live(label, BarColumn(), MofNCompleteColumn(), _RateColumn()) as update:
            yield lambda done, total: update(completed=done, total=total)

    @contextlib.contextmanager
    def spinner(self, label: str) -> Iterator[None]:
        with self._live(label):
            yield


def _headline(text: str, colours: str | dict[str, str]) -> None:
    """A report's first line, its verdict word coloured: by the verdict (``colours`` a dict, red for
    any verdict it does not name) or as ``colours`` says."""
    word, _, rest = text.partition(":")
    colour = colours if isinstance(colours, str) else colours.get(word, "red")
    out.print(f"[{colour}]{word}[/]:{escape(rest)}")


def print_generated(result: GeneratedText) -> None:
    """Generated text: on stdout, or a note of the new file it went to."""
    if result.written is None:
        click.echo(result.text, nl=False)
    else:
        err.print(f"wrote {escape(result.written)}")


# --------------------------------------------------------------------------------------------- specs
def print_lint(report: LintReport) -> None:
    for r in report.results:
        for issue in r.issues:
            click.echo(str(issue), err=True)
        if r.ok:
            click.echo(f"{r.file}: ok" + "".join(f"\n  {c}" for c in r.checked))


def print_explanation(ex: Explanation) -> None:
    out.print(f"[bold]{escape(ex.spec)}[/] ({escape(ex.file)}): L={ex.num_layers}, hidden={ex.hidden_size}")
    cols = [c for c in ("hf", "sglang", "vllm", "eagle", "trtllm", "modelopt-hf", "modelopt-trtllm", "modelopt-vllm")
            if c in ex.conventions]
    table = Table(show_lines=False)
    for h in ("capture", "point", "fc slot", "dump slot", *cols):
        table.add_column(h)
    footnotes: list[str] = []
    for row in ex.rows:
        cells = []
        for c in cols:
            v = row.ids.get(c)
            if isinstance(v, str):
                footnotes.append(f"{row.name} / {c}: {v}")
                cells.append(f"[red]n/e[{len(footnotes)}][/]")
            else:
                cells.append(str(v))
        table.add_row(row.name, row.point, "-" if row.fc_slot is None else str(row.fc_slot), row.dump_slot or "-", *cells)
    out.print(table)
    for i, f in enumerate(footnotes, 1):
        out.print(f"  [{i}] {escape(f)}")
    out.print("fc lists:")
    for k, lst in ex.fc_lists.items():
        out.print(f"  {k:15} " + (f"{lst.ids} -> {', '.join(lst.captures)}" if lst.ok else f"[red]{escape(lst.error or '')}[/]"))
    out.print("conventions:")
    for k, v in ex.conventions.items():
        out.print(f"  {k:15} {escape(v)}")
    for n in ex.notes:
        out.print(f"[yellow]note:[/] {escape(n)}")


def print_rendering(r: Rendering) -> None:
    out.print(f"[bold]{escape(r.spec)}[/] for {r.target}" + (f" ({escape(r.model_class)})" if r.model_class else "")
              + (f" on platform {escape(r.platform)}" if r.platform else ""))
    out.print(f"convention: {escape(r.convention)} ({escape(r.origin)})")
    out.print(f"ids: {r.ids}")
    for c in r.captures:
        where = f", captured at {c.site}" if c.site else ""
        caveat = " [yellow]unverified[/]" if c.verified is False else ""
        out.print(f"  fc slot {c.fc_slot}: {c.name} = {c.point}  (replayed: {c.captured}{where}){caveat}")
    if not r.verified:
        out.print(f"[yellow]unverified:[/] {escape(r.unverified_reason or '')}")
    for e in r.evidence:
        out.print(f"[dim]evidence: {escape(e)}[/]")
    out.print("draft config fragment:")
    out.print(json.dumps(r.draft_config, indent=2), markup=False)
    out.print("launch: " + r.launch_shell, markup=False)
    if r.dump:
        out.print("dump: " + json.dumps(r.dump), markup=False)
    for n in r.notes:
        out.print(f"[yellow]note:[/] {escape(n)}")


def print_draft_check(r: DraftReport) -> None:
    model_class = f" ({escape(r.model_class)})" if r.model_class else ""
    out.print(f"[bold]{escape(r.draft)}[/] on {r.engine}{model_class} against {escape(r.spec)}")
    out.print(f"  expected fc input: {', '.join(r.expected)}")
    out.print(f"  engine captures:   {', '.join(str(c) for c in r.captured)}")
    style = {"error": "red", "warning": "yellow", "info": "dim"}
    for f in r.findings:
        out.print(f"  [{style[f.severity]}]{f.severity}[/] {f.kind}: {escape(f.detail)}")
    if r.norms:  # per norm flag: what the engine's draft model file does with it
        out.print("  norm flags: " + "; ".join(f"{n.flag} {n.state.replace('_', ' ')}" + (f" at {escape(n.used_at)}"
                                                   if n.used_at else "") for n in r.norms))
    out.print("[green]ok[/]" if r.ok else "[red]mismatch[/]")


def print_inferred_wiring(r: InferReport) -> None:
    data = output_of("infer-wiring", r)
    assert isinstance(data, InferWiringOutput)
    _headline(data.headline, "green" if data.decided else "yellow")
    out.print(f"[bold]{escape(data.draft)}[/] ({escape(data.fc_tensor)}) against {escape(data.target)}: "
              f"{data.n_slots} fc slots, {data.num_layers} layers, {data.tokens} tokens")
    table = Table(title="weight space: each fc slot's alignment with each point's states (relative to its slot)")
    for h in ("slot", "point", "score", "runner-up", "score", "margin", "decides"):
        table.add_column(h)
    for x in data.weight_space.slots:
        margin = "-" if x.margin is None else f"{100 * x.margin:.1f}%"
        table.add_row(str(x.slot), x.point, f"{x.score:.4g}", x.runner_up or "-",
                      "-" if x.runner_up_score is None else f"{x.runner_up_score:.4g}", margin,
                      "[green]yes[/]" if x.decides else
                      "[yellow]contradicted by behaviour[/]" if x.contradicted else "[yellow]does not decide[/]")
    out.print(table)
    b = data.behaviour
    if b is not None:
        def num(x: Any, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)

        out.print(f"behaviour over {b.evaluations} wirings: divergence from the target {num(b.divergence, '.4f')} "
                  f"nats ({b.steps} chained steps), step-1 agreement {num(b.agreement, '.1%')}")
        out.print(f"  runner-up {', '.join(b.runner_up or ['-'])}: divergence {num(b.runner_up_divergence, '.4f')}, "
                  f"agreement {num(b.runner_up_agreement, '.1%')}; margin {num(b.margin, '+.4f')} nats, "
                  f"{num(b.z, '.1f')} standard errors" + ("" if b.decides else ": [yellow]does not decide[/]"))
    verdict = "" if data.decided else " [yellow](the evidence does not decide: see margins)[/]"
    out.print(f"inferred fc input: [bold]{', '.join(data.wiring)}[/]{verdict}")
    for target, ids in data.ids.items():
        none = f"{'refused' if ids.kind == 'refused' else 'not expressible'}: {ids.error or 'no reason given'}"
        out.print(f"  {target}: " + (str(ids.ids) if ids.ids is not None else f"[dim]{escape(none)}[/]"))
    stated = data.stated
    if not stated.ids:
        out.print("[red]the draft config states no ids[/]: every engine silently uses its default")
    for e in stated.engines:
        mark = {True: "[green]agrees[/]", False: "[red]disagrees[/]", None: "[dim]not checked[/]"}[e.agrees]
        if e.reads is None and not e.captures:  # not read (see the problems), or nothing stated
            out.print(f"  stated ids, {e.engine}: {mark}")
        else:
            reads = "no ids (the model's default)" if e.reads is None else str(e.reads)
            got = ", ".join("nothing" if c is None else str(c) for c in e.captures) or "nothing"
            out.print(f"  stated ids, {e.engine}: reads {reads} -> {got}: {mark}")
        for p in e.problems:
            out.print(f"    {escape(p)}")
    for note in data.notes:
        out.print(f"[dim]note: {escape(note)}[/]")
    if data.written:
        out.print(f"spec written to {escape(data.written)}")
    against = [e.engine for e in stated.engines if e.agrees is False]
    if data.ok:  # exit 0: ids stated, and no decided wiring they disagree with
        if not data.decided:
            text = "nothing contradicts the draft config's ids (the evidence does not decide)"
        elif stated.agree is None:
            text = "the inferred wiring is decided; the config's ids were checked against no engine (see above)"
        else:
            text = "the inferred wiring is decided and the draft config's ids agree with it"
        out.print(f"[green]ok[/]: {text}")
    else:  # exit 3: no ids stated, or a decided wiring some engine's reading of them disagrees with
        why = ["the config states no ids"] if not stated.ids else [
            f"the config's ids disagree with the decided wiring for {', '.join(against)}"]
        out.print(f"[red]mismatch[/]: {'; '.join(why)}")


def print_accept(r: AcceptReport) -> None:
    _headline(r.headline, {"separated": "green", "undecided": "yellow"})
    out.print(f"[bold]{escape(r.draft)}[/] on {escape(r.target)} against {escape(r.spec)}: {r.steps} draft steps, "
              f"greedy, {r.n_prompts} prompts continued to {r.length} tokens")
    out.print(f"  prompts: {escape(r.prompts)}")
    table = Table(title="teacher-forced acceptance (P(accepted > j) per draft position)")
    for h in ("wiring", "points", *(f"pos {j + 1}" for j in range(r.steps)), "accept len", "KL (nats)", "note"):
        table.add_column(h)
    for row in r.rows:
        pts = ", ".join("-" if p is None else str(p) for p in row.wiring.points)
        if row.per_position is None or row.expected_accepted is None:
            cells = ["-"] * r.steps + ["-", "-", escape("; ".join(x for x in (row.not_servable, row.wiring.note) if x))]
        else:
            kl = "-" if row.divergence is None else f"{row.divergence:.3f}"
            cells = [f"{x:.1%}" for x in row.per_position] + [f"{1 + row.expected_accepted:.2f}", kl,
                                                              escape(row.wiring.note or "")]
        table.add_row(escape(row.wiring.name), escape(pts), *cells)
    out.print(table)
    for note in r.notes:
        out.print(f"  [dim]note[/] {escape(note)}")
    out.print(f"  [dim]{escape(r.sampling)}[/]")
    if r.min_rate is not None:
        out.print(f"[green]at least {r.min_rate:.1%}[/]" if r.above_min
                  else f"[red]the spec's position-1 acceptance is below {r.min_rate:.1%}[/]")


_SERVED = {"same": "served the same", "differently": "SERVED DIFFERENTLY", "undecided": "undecided",
           "not_deployed": "not deployed"}


def _upgrade_spec_line(s: SpecUpgrade) -> str:
    before = s.before if s.before is not None else "refused"
    after = s.after if s.after is not None else "refused"
    return f"{s.spec} ({s.model_class}): ids {before} -> {after}; deployed config {_SERVED[s.served]}"


def _upgrade_details(r: UpgradeReport, change: Change) -> str:
    where = [f"{r.before.version}: {', '.join(change.before_at) or '-'}",
             f"{r.after.version}: {', '.join(change.after_at) or '-'}"]
    return f"  {change.subject}: {change.aspect}: " + "; ".join(where)


def print_upgrade_check(r: UpgradeReport) -> None:
    """One line when nothing changed; else one line per spec and per change, then the reasons and
    the file:line of each change on both sides."""
    head = f"{r.engine} {r.before.version} -> {r.after.version}"
    if not r.changed:
        out.print(f"{escape(head)}: nothing changed for {len(r.specs)} spec(s) or any of {r.classes_compared} classes")
        return
    colour = "red" if r.served_differently else "yellow" if r.undecided else "green"
    out.print(f"[{colour}]{escape(head)}[/]: {len(r.served_differently)} spec(s) served differently, "
              f"{len(r.undecided)} undecided; {sum(len(d.changes) for d in r.classes)} class change(s), "
              f"{len(r.runner)} runner change(s)")
    changes = [c for d in r.classes for c in d.changes] + r.runner
    for s in r.specs:
        out.print(escape(_upgrade_spec_line(s)))
    for c in changes:
        out.print(escape(c.summary))
    out.print("details:")
    for s in r.specs:
        for why in s.reasons:
            out.print(escape(f"  {s.spec}: {why}"))
    for c in changes:
        out.print(escape(_upgrade_details(r, c)))


def print_plan(p: Plan) -> None:
    """One line per need with the recommended route; one line per route and need with its verdict;
    then the recommended routes' launches and steps, and every hazard once."""
    release = f"{p.engine} {p.release}" if p.release else p.engine
    for need, route in p.recommended.items():
        colour = "green" if route else "red"
        out.print(f"[{colour}]{escape(need)}[/]: {escape(route or 'no route works')} "
                  f"({escape(p.spec)} on {escape(release)}{', pp ' + str(p.pp) if p.pp > 1 else ''})")
    for r in p.routes:
        for need, v in r.verdicts.items():
            out.print(escape(f"  {r.route:<6} {need:<5} {v.state:<9} {v.why}"))
    for route in dict.fromkeys(x for x in p.recommended.values() if x):
        chosen = p.route(route)
        for step in chosen.steps:
            out.print(escape(f"{route}: {step}"))
        if chosen.launch:
            out.print(escape(f"{route}: {chosen.launch_shell}"))
        for name, value in chosen.config.items():
            out.print(escape(f"{route}: {name}: {json.dumps(value)}"))
        for label in chosen.labels:
            out.print(escape(f"{route}: read back: {label}"))
        for h in chosen.hazards:
            out.print(escape(f"{route}: hazard: {h}"))
    if p.sidecar:
        out.print(escape(f"sidecar: {p.sidecar}"))
    for n in p.notes:
        out.print(escape(f"note: {n}"))


def _convention_groups(probe: EngineProbe) -> dict[tuple, list]:
    """Classes whose id rule, default, ordering and capture site are identical, together."""
    groups: dict[tuple, list] = {}
    for c in probe.classified:
        key = (c.id_rule.name if c.id_rule else "?", ", ".join(map(str, c.default)) if c.default else "none",
               c.default_through_rule, c.sorts, c.dedups, c.capture_site, c.captured_value)
        groups.setdefault(key, []).append(c)
    return groups


def print_conventions(engine: str, probe: EngineProbe, show_all: bool) -> None:
    out.print(f"[bold]{engine} {escape(probe.version)}[/] at {escape(probe.root)}: {probe.files_scanned} model files, "
              f"platform {escape(probe.platform)}")
    table = Table(title="conventions (classes grouped by identical rules)")
    for h in ("id -> capture index", "default", "sorted/dedup", "captured at", "value", "classes"):
        table.add_column(h)
    groups = sorted(_convention_groups(probe).items(), key=lambda kv: -len(kv[1]))
    for (rule, default, through, sorts, dedups, site, value), classes in groups:
        names = sorted(c.class_name for c in classes)
        shown = names if show_all or len(names) <= 6 else names[:6] + [f"... {len(names) - 6} more (--all)"]
        table.add_row(rule, f"{default}{' (through the rule)' if through else ''}",
                      f"{'sorted' if sorts else 'layer order'}/{'dedup' if dedups else 'dups kept'}",
                      f"layer {site}", value, "\n".join(shown))
    out.print(table)
    for c in probe.classified:
        for b in c.bypasses:
            out.print(f"[yellow]bypass[/] {c.class_name} ({escape(b.path or c.path)}:{b.line}): "
                      f"{escape(b.description)} (when: {escape(b.layers)})")
    for c in probe.classified:
        if not c.verified:
            out.print(f"[yellow]unverified[/] {c.class_name} ({escape(c.path)}:{c.line}): {escape(c.unverified_reason or '')}")
    for c in probe.unclassified:
        tag = ("[yellow]no capture[/]" if c.no_capture else "[yellow]delegates[/]" if c.delegates
               else "[red]unclassified[/]")
        out.print(f"{tag} {c.class_name} ({escape(c.path)}:{c.line}): {escape(c.reason or '')}")
    for path, why in sorted(probe.unreadable.items()):
        out.print(f"[red]unreadable[/] {escape(path)}: {escape(why)}")
    runner = probe.runner
    if runner is not None:
        tag = "[green]runner[/]" if runner.verified else "[yellow]runner (unverified)[/]"
        out.print(f"{tag}: {escape(runner.reason or '')}")
    for _arch, d in sorted(probe.dispatch.items()):  # registered classes picked per platform
        if d.disagree or show_all:
            tag = "[red]unverified[/]" if not d.here.verified else "[yellow]platforms differ[/]" if d.disagree else "dispatch"
            out.print(f"{tag} {escape(d.text())} ({escape(d.here.evidence)})")
    for group, n in probe.coverage().items():
        out.print(f"{group}: {n['total']} classes, {n['classified']} classified, "
                  f"{n['no_capture']} shown by the source not to capture, "
                  f"{n.get('delegates', 0)} handing the ids to a text model the checkpoint picks, "
                  f"{n['unclassified']} unclassified")


# --------------------------------------------------------------------------------------------- harness
def print_match(result: HarnessResult) -> None:
    table = Table()
    for h in ("slot", "declared", "matched", "rel err", "margin", "verdict"):
        table.add_column(h)
    style = {"ok": "green", "mismatch": "red", "no_match": "red", "unlabelled": "yellow", "undecided": "yellow"}
    for s in result.report.slots:
        table.add_row(s.name, str(s.declared or "-"), str(s.matched or "none"), f"{s.rel_err:.4f}",
                      s.margin_text, f"[{style.get(s.verdict, 'white')}]{s.verdict}[/]")
    _headline(result.headline, {"ok": "green", "identified": "green", "undecided": "yellow"})
    out.print(f"{escape(result.subject.source)} ({result.subject.layout}) vs {escape(str(result.reference_source))}; "
              f"tokens: {escape(result.alignment)}")
    out.print(table)
    for d in result.report.diagnosis:
        out.print(f"[red]{d.kind}[/]: {escape(d.detail)}")
    if result.report.suggested_captures and not result.ok:
        out.print("suggested captures: " + ", ".join(f"{k}: {v}" for k, v in result.report.suggested_captures.items()))
    for engine, ids in result.engine_ids.items():
        out.print(f"  {engine} ids: {escape(str(ids))}")
    for n in result.notes:
        out.print(f"[dim]note: {escape(n)}[/]")


def print_audit(report: AuditReport) -> None:
    from surgeon.audit.summary import counts, histogram

    j = output_of("audit", report)
    assert isinstance(j, AuditOutput)
    _headline(j.headline, {"ok": "green", "undecided": "yellow"})
    out.print(f"{escape(j.root)}: {j.files} files ({', '.join(f'{v} {k}' for k, v in j.layouts.items())}), "
              f"{j.resumed} from the resume state; {j.files_per_s or '-'} files/s, {j.mb_per_s or '-'} MB/s "
              f"({j.backend}, {j.workers} worker{'s' if j.workers != 1 else ''})")
    table = Table()
    for h in ("slot", "declared", "files", "norm mean", "ok", "mismatch", "no_match", "unresolved", "not_run",
              "exact", "undecided", "identity (nearest point: files)"):
        table.add_column(h)
    for s in j.slots:
        bars, more = histogram(s, 4)
        ident = ", ".join(f"{k}: {v}" for k, v in bars) + (f", +{more} more" if more else "")
        exact = ", ".join(f"{k} {v}" for k, v in s.exact_verdicts.items() if v)
        open_ = f"[yellow]{s.undecided}[/]" if 2 * s.undecided > s.files else str(s.undecided)
        table.add_row(s.name, s.declared or "-", str(s.files),
                      "-" if s.norm_mean is None else f"{s.norm_mean:.4g}",
                      *(str(s.verdicts.get(v, 0)) for v in ("ok", "mismatch", "no_match", "unresolved", "not_run")),
                      escape(exact) or "-", open_, escape(ident))
    out.print(table)
    for o in j.outliers[:20]:
        out.print(f"[red]{escape(o.path)}[/]")
        for f in o.findings:
            out.print(f"  {f.kind}{' ' + escape(f.slot) if f.slot else ''}: {escape(f.detail)}")
    if j.outliers_listed > 20:
        out.print(f"... and {j.flagged - 20} more flagged files (--json lists {j.outliers_listed})")
    for n in j.notes:
        out.print(f"[dim]note: {escape(n)}[/]")
    if j.report:
        out.print(f"report: {escape(j.report)}")
    if j.undecided:
        out.print(f"[yellow]identity undecided for most files of {escape(', '.join(j.undecided))}: this run cannot "
                  f"see {escape(', '.join(j.cannot_see))}[/]")
    if j.flagged:
        out.print(f"[red]{j.flagged} of {j.files} files flagged: "
                  + escape(", ".join(f"{k} {v}" for k, v in j.findings.items())) + "[/]")
    else:
        out.print("[green]every file is what the spec declares[/]" if j.ok else
                  "[yellow]no finding, but the identity is undecided: not a pass (exit 4)[/]")
    for s in j.slots:
        out.print(f"  {escape(s.name)} identity: {escape(counts(s))}")


def print_dump_info(info: DumpInfo) -> None:
    m = info.meta
    if info.layout != "surgeon":
        _print_field_dump_info(info)
        return
    out.print(f"[bold]{escape(info.file)}[/]: spec {escape(m.get('spec.name') or '-')} "
              f"(sha256 {m.get('spec.sha256', '')[:12] or '-'}), "
              f"{escape(m.get('engine') or '?')} {escape(m.get('engine.version', ''))}, model {escape(m.get('model') or '?')}, "
              f"{m.get('tokens')} tokens, {m.get('dtype')}")
    for c in info.captures:
        out.print(f"  {c.name}: {c.point} {c.shape}")


def _print_field_dump_info(info: DumpInfo) -> None:
    """A field or training dump: what it is, who could have written it, each slot's point."""
    m, p = info.meta, info.producer
    what = {"trtllm": "TensorRT-LLM SaveHiddenStates dump", "modelopt": "Model Optimizer collect_hidden_states dump",
            "specforge": "SpecForge training file"}.get(info.layout, f"hidden_states stack ({m.get('engine')})")
    out.print(f"[bold]{escape(info.file)}[/]: {what}, {len(info.records)} record(s); the first: {m.get('tokens')} tokens, "
              f"hidden {m.get('hidden_size')}, {m.get('dtype')}")
    if p is not None:
        out.print(f"  written by: {escape(' or '.join(p.detected))} ({escape(p.why)})")
        out.print(f"  labelled by: {escape('--slots ' + p.given) if p.given else '[yellow]nothing (no --slots)[/]'}")
    for c in info.captures:
        point = c.point if c.point is not None else "[yellow]not recorded[/]"
        out.print(f"  {escape(c.name)}: {point} {c.shape} {c.dtype}")
    for r in info.records[:10]:
        mask = f", {r.loss_mask} in the loss" if r.loss_mask is not None else ""
        out.print(f"  record {r.index} ({escape(r.id or '-')}): {r.tokens} tokens, "
                  f"input ids {'yes' if r.input_ids else 'no'}{mask}")
    if len(info.records) > 10:
        out.print(f"  ... and {len(info.records) - 10} more records (--json lists them)")
    for n in info.notes:
        out.print(f"[dim]note: {escape(n)}[/]")


def print_hook_check(check: HookCheck) -> None:
    for x in check.findings:
        click.echo(str(x))
    if not check.findings:
        click.echo(f"{check.files} file(s): no graph-unsafe operations")


# --------------------------------------------------------------------------------------------- patches
def print_apply(outcome: ApplyOutcome) -> None:
    p = outcome.plan
    if outcome.diff is not None:
        click.echo(outcome.diff, nl=False)
    if outcome.plugin is not None:
        return _print_plugin(outcome)
    if outcome.result is not None and outcome.result.recovered:
        err.print(f"recovered first: {escape(outcome.result.recovered)}")
    where = f"{p.engine} {p.engine_version} at {p.engine_root}"
    if not outcome.applied:
        out.print(f"dry run: patch {escape(p.name)} would change {escape(p.model_file)} "
                  f"({len(p.anchors)} insertions) and create {escape(p.hooks_file)} in {escape(where)}; nothing written")
    elif outcome.result is not None and not outcome.result.changed:
        out.print(f"patch {escape(p.name)} is already applied to {escape(p.model_file)} in {escape(where)}; nothing to do")
    else:
        replaced = f" (replaced {', '.join(outcome.result.replaced)})" if outcome.result and outcome.result.replaced else ""
        out.print(f"applied patch {escape(p.name)}{escape(replaced)}: {escape(p.model_file)} "
                  f"[{escape(p.loop_class or 'its decoder loop')}, recipe {escape(p.recipe)}] "
                  f"and {escape(p.hooks_file)} in {escape(where)}")
    if p.anchors:
        out.print("\n".join(f"  {escape(a)}" for a in p.anchors))


def _print_plugin(outcome: ApplyOutcome) -> None:
    b, p = outcome.plugin, outcome.plan
    out.print(f"built plugin {escape(b.package)} in {escape(str(b.out))} for {escape(p.engine)} {escape(p.engine_version)}: "
              f"carries {escape(p.model_file)} [{escape(p.loop_class or 'its decoder loop')}] and {escape(b.hooks_module)}; "
              f"the engine root was only read; insertions: {escape(', '.join(p.anchors))}")
    out.print(f"use: {escape(b.activate)}")
    out.print(f"or install: {escape(b.install)}; revert: {escape(b.uninstall)}")


def print_revert(report: RevertReport) -> None:
    if not report.reverted:
        out.print("no surgeon patches applied; nothing to revert")
    for r in report.reverted:
        if r.recovered:
            err.print(f"recovered first: {escape(r.recovered)}")
        out.print(f"reverted {escape(', '.join(r.reverted))} in {r.engine} at {escape(r.engine_root)}: "
                  f"{len(r.restored)} file(s) restored byte-identical")
        for w in r.warnings:
            err.print(f"warning: {escape(w)}")


def print_status(report: StatusReport) -> None:
    from surgeon.patch.manifest import ABSENT

    for line in report.recovered:
        err.print(f"recovered: {escape(line)}")
    for line in report.pending:
        err.print(f"[bold red]pending:[/] {escape(line)}")
    for engine, u in report.unrecorded:
        err.print(f"[bold red]patched but unrecorded:[/] {engine} {escape(u.relpath)} carries surgeon patch "
                  f"{escape(u.marker.name)} (manifest {u.marker.manifest_id}); {escape(u.advice())}")
    if not report.patches:
        out.print("no surgeon patches recorded" if report.unrecorded else "no surgeon patches applied")
        return
    table = Table("engine", "patch", "spec", "state", "file", "file state")
    for row in report.patches:
        p = row.patch
        for i, f in enumerate(p.files):
            style = "" if f.state == "applied" else "bold red"
            what = f"{f.relpath} (created)" if f.sha256_before == ABSENT else f.relpath
            table.add_row(f"{row.engine} {p.engine_version}" if i == 0 else "", p.name if i == 0 else "",
                          f"{p.spec_name} {p.spec_sha256[:12]}" if i == 0 else "",
                          p.state if i == 0 else "", escape(what), f"[{style}]{f.state}[/]" if style else f.state)
    out.print(table)


def print_doctor(report: DoctorReport) -> None:
    for engine, r in report.results:
        if not r.findings:
            out.print(f"{engine} {escape(str(r.root))}: patch state healthy")
        for f in r.findings:
            mark = "[green]fixed[/]" if f.fixed else ("[yellow]repairable[/]" if f.repairable else "[bold red]problem[/]")
            out.print(f"{mark} {engine} {escape(f.path)}: {escape(f.problem)}; {escape(f.action)}")


def print_coverage(report: CoverageReport, show_all: bool) -> None:
    from surgeon.patch.coverage import render_coverage_lines

    for line in render_coverage_lines(report, all_classes=show_all):
        click.echo(line)


# --------------------------------------------------------------------------------------------- demo
@contextlib.contextmanager
def demo_display(as_json: bool, started: float, console: Console | None = None, heartbeat_s: float | None = None
                 ) -> Iterator[tuple[Callable[[str], None], Callable[[str], None]]]:
    """The demo's (step, note) callbacks: each step's line with the time since the start, then,
    while it runs, its elapsed time (a live spinner on a terminal, a line every HEARTBEAT_S seconds
    in a log), so the minute-long vLLM start-up is never silent."""
    import time

    console = console or err
    n = [0]
    with contextlib.ExitStack() as stack:
        live: Progress | None = None
        heartbeat: Heartbeat | None = None
        if console.is_terminal and not as_json:
            live = stack.enter_context(Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                                console=console, transient=True))
            task = live.add_task("", total=None)
        else:
            beat = lambda what, s: console.print(f"      ... {escape(what)}: {s:.0f} s", highlight=False)
            heartbeat = stack.enter_context(Heartbeat(beat, HEARTBEAT_S if heartbeat_s is None else heartbeat_s))

        def step(title: str) -> None:
            n[0] += 1
            line = f"[{n[0]}/8] {title}"
            console.print(f"[bold]{escape(line)}[/]  [dim]{time.perf_counter() - started:5.1f} s[/]")
            if live is not None:
                live.reset(task, description=escape(line))
            if heartbeat is not None:
                heartbeat.step(f"still at step {n[0]}/8")

        def note(text: str) -> None:
            console.print(f"      {escape(text)}")

        yield step, note


def print_demo(report: DemoReport, started: float) -> None:
    import time

    result = report.result
    out.print("\n[bold]the spec's wiring[/] (what vLLM captured, checked against the HF reference):")
    print_match(result.right)
    out.print("\n[bold]a mis-wired variant[/] (the same dump, labelled as the Kimi-K2.5 dumps were):")
    print_match(result.wrong)
    if result.draft is not None:
        d = result.draft
        out.print(f"\n[bold]the draft as evidence[/] (trained on {', '.join(d.trained_on)}; "
                  "what infer-wiring names from its weights and behaviour alone):")
        print_inferred_wiring(d.inferred)
        out.print("\n[bold]its acceptance[/] under the inferred wiring and the wirings bugs produce:")
        print_accept(d.accept)
    out.print("")
    rows = [("work folder", result.workdir), ("tiny model", result.model), ("spec", result.spec),
            ("mis-wired spec", result.wrong_spec), ("HF reference", result.reference), ("vLLM dump", result.dump),
            ("heatmap (mis-wired)", result.heatmap), ("heatmap (right)", result.heatmap_right),
            ("patched, then reverted" if result.route == "patch" else "read by the plugin, never written",
             result.engine_root / result.model_file)]
    if result.draft is not None:
        rows += [("draft (cached)", result.draft.draft), ("its inferred spec", result.draft.spec)]
    table = Table("what", "where", show_header=False)
    for what, where in rows:
        table.add_row(what, escape(str(where)))
    out.print(table)
    out.print(f"route: {result.route}; model file byte-identical after the run: {result.reverted_identical}; "
              f"total {time.perf_counter() - started:.0f} s")
    if report.ok:
        out.print("[green]demo ok[/]: the wiring is proven on the real engine, the mis-wiring is named slot by slot, "
                  "and the draft's own wiring is read from its weights and behaviour")
