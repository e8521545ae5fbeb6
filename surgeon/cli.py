"""The `surgeon` command line: a thin shell over the library (``surgeon.core.spec``, ``surgeon.wiring.render``,
``surgeon.wiring.lint``, ``surgeon.wiring.draft``, ``surgeon.wiring.review``, ``surgeon.engines.probe``).

Exit codes: 0 fine; 2 bad input (a one-line message per problem, located where there is a file;
nothing written); 3 the checked wiring differs from the spec; 1 internal error.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from surgeon import __version__
from surgeon.core.errors import BadInput, Mismatch
from surgeon.patch.manifest import ABSENT
from surgeon.patch.apply import DEFAULT_MAX_TOKENS
from surgeon.core.spec import SpecError, load_spec

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
if not out.is_terminal:  # piped into a file or a CI log: do not wrap tables at 80 columns
    out = Console(highlight=False, soft_wrap=True, width=200)

ENGINE_CHOICE = click.Choice(["sglang", "vllm"])


class _Group(click.Group):
    """Turns library errors into the documented exit codes, without tracebacks."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except SpecError as e:
            for issue in e.issues:
                click.echo(str(issue), err=True)
            ctx.exit(2)
        except BadInput as e:
            click.echo(f"surgeon: {e}", err=True)
            ctx.exit(2)
        except Mismatch as e:
            click.echo(f"surgeon: {e}", err=True)
            ctx.exit(3)
        except KeyboardInterrupt:
            click.echo("surgeon: interrupted", err=True)
            ctx.exit(130)
        except Exception as e:  # internal error: one line, unless asked for the traceback
            if os.environ.get("SURGEON_DEBUG"):
                raise
            click.echo(f"surgeon: internal error: {type(e).__name__}: {e} (SURGEON_DEBUG=1 shows the traceback)", err=True)
            ctx.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="surgeon")
def main() -> None:
    """Declarative hidden-state wiring for speculative-decoding drafts.

    A spec names, in physical terms (embed, layer_out[k], final_norm), what a draft's fc reads;
    surgeon translates it to every engine's ids, checks drafts and engines against it, and
    explains changes to reviewers.
    """


def _write_new_or_stdout(text: str, output: str | None) -> None:
    """Print ``text``, or write it to a new file ``output`` (an existing file is never overwritten)."""
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        with open(output, "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise BadInput(f"{output} exists; not overwritten") from None
    except OSError as e:
        raise BadInput(f"{output}: {e.strerror or e}") from None
    err.print(f"wrote {escape(output)}")


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def _progress(label: str) -> Progress:
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True, disable=not err.is_terminal)


def _open_with_progress(engine: str, root: str | None):
    from surgeon.engines.view import open_engine

    with _progress(f"probing {engine} source") as bar:
        task = bar.add_task("probe", total=None)

        def hook(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return open_engine(engine, root, progress=hook)


# ---------------------------------------------------------------------------------------------
@main.command()
def schema() -> None:
    """Print the JSON Schema of spec v1 (for editors' completion and validation)."""
    from surgeon.core.spec import json_schema

    _emit_json(json_schema())


# ---------------------------------------------------------------------------------------------
@main.command()
@click.argument("specs", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--engine", "engines", multiple=True, type=ENGINE_CHOICE, help="Check this engine (repeatable; default: the spec's engines section, else all).")
@click.option("--engine-root", type=click.Path(), help="Engine package directory to probe (with a single --engine).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
def lint(specs: tuple[str, ...], engines: tuple[str, ...], engine_root: str | None, as_json: bool) -> None:
    """Validate specs, and check each engine can feed the draft exactly what they declare.

    Exit 0 when every spec is clean (warnings allowed), 2 when any has an error.
    """
    from surgeon.wiring.lint import lint_files

    if engine_root and len(engines) != 1:
        raise BadInput("--engine-root needs exactly one --engine")
    roots = {engines[0]: engine_root} if engine_root else {}
    for e in set(engines) or {"sglang", "vllm"}:
        _open_with_progress(e, roots.get(e))
    results = lint_files(specs, engines=engines, roots=roots)
    if as_json:
        _emit_json({"ok": all(r.ok for r in results), "specs": [r.to_json() for r in results]})
    else:
        for r in results:
            for issue in r.issues:
                click.echo(str(issue), err=True)
            if r.ok:
                click.echo(f"{r.file}: ok" + "".join(f"\n  {c}" for c in r.checked))
    if not all(r.ok for r in results):
        sys.exit(2)


# ---------------------------------------------------------------------------------------------
def _roots(engine: str | None, engine_root: str | None) -> dict[str, str | None]:
    if engine_root and not engine:
        raise BadInput("--engine-root needs --engine")
    return {engine: engine_root} if engine and engine_root else {}


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--engine", type=ENGINE_CHOICE, help="Engine whose --engine-root / --model-class are given.")
@click.option("--engine-root", type=click.Path(), help="Engine package directory to probe.")
@click.option("--model-class", help="Engine model class (default: the spec's pin, else target.architecture).")
@click.option("--json", "as_json", is_flag=True)
def explain(spec: str, engine: str | None, engine_root: str | None, model_class: str | None, as_json: bool) -> None:
    """Per capture: its point, every convention's id (or why none), fc slot and dump slot."""
    from surgeon.wiring.render import explain as do_explain

    s = load_spec(spec)
    roots = _roots(engine, engine_root)
    for e in ("sglang", "vllm"):
        _open_with_progress(e, roots.get(e))
    ex = do_explain(s, roots=roots, model_classes={engine: model_class} if engine and model_class else {})
    if as_json:
        _emit_json(ex.to_json())
        return
    out.print(f"[bold]{escape(ex.spec)}[/] ({escape(ex.file)}): L={ex.num_layers}, hidden={ex.hidden_size}")
    cols = [c for c in ("hf", "sglang", "vllm", "eagle") if c in ex.conventions]
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
        out.print(f"  {k:7} " + (f"{lst.ids} -> {', '.join(lst.captures)}" if lst.ok else f"[red]{escape(lst.error or '')}[/]"))
    out.print("conventions:")
    for k, v in ex.conventions.items():
        out.print(f"  {k:7} {escape(v)}")
    for n in ex.notes:
        out.print(f"[yellow]note:[/] {escape(n)}")


# ---------------------------------------------------------------------------------------------
@main.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--engine", "target", required=True, type=click.Choice(["sglang", "vllm", "specforge", "speculators"]))
@click.option("--engine-root", type=click.Path(), help="Engine package directory to probe.")
@click.option("--model-class", help="Engine model class (default: the spec's pin, else target.architecture).")
@click.option("--pin", is_flag=True, help="Write engines.<engine> pins for the installed engine into SPEC (comments and order kept).")
@click.option("--json", "as_json", is_flag=True)
def render(spec: str, target: str, engine_root: str | None, model_class: str | None, pin: bool, as_json: bool) -> None:
    """The draft-config fragment and launch flags for an engine or training tool."""
    from surgeon.wiring.render import render as do_render

    s = load_spec(spec)
    engine = {"speculators": "vllm", "specforge": None}.get(target, target)
    if engine:
        _open_with_progress(engine, engine_root)
    if pin and target not in ("sglang", "vllm"):
        raise BadInput("--pin needs --engine sglang or vllm")
    r = do_render(s, target, engine_root=engine_root, model_class=model_class)
    if pin:
        from surgeon.wiring.pins import pin_values, write_pins

        values = pin_values(s, target, engine_root=engine_root, model_class=model_class)
        write_pins(spec, target, values)
        err.print(f"pinned engines.{target} in {escape(spec)}: {escape(str(values))}")
    if as_json:
        _emit_json(r.to_json())
        return
    out.print(f"[bold]{escape(r.spec)}[/] for {r.target}" + (f" ({escape(r.model_class)})" if r.model_class else ""))
    out.print(f"convention: {escape(r.convention)} ({escape(r.origin)})")
    out.print(f"ids: {r.ids}")
    for c in r.captures:
        out.print(f"  fc slot {c['fc_slot']}: {c['name']} = {c['point']}  (replayed: {c['captured']})")
    out.print("draft config fragment:")
    out.print(json.dumps(r.draft_config, indent=2), markup=False)
    out.print("launch: " + " ".join(r.launch_flags), markup=False)
    if r.dump:
        out.print("dump: " + json.dumps(r.dump), markup=False)
    for n in r.notes:
        out.print(f"[yellow]note:[/] {escape(n)}")


# ---------------------------------------------------------------------------------------------
@main.command("check-draft")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.argument("draft", type=click.Path())
@click.option("--engine", required=True, type=click.Choice(["sglang", "vllm", "specforge", "speculators"]))
@click.option("--engine-root", type=click.Path(), help="Engine package directory to probe.")
@click.option("--model-class", help="Engine model class (default: the spec's pin, else target.architecture).")
@click.option("--json", "as_json", is_flag=True)
def check_draft(spec: str, draft: str, engine: str, engine_root: str | None, model_class: str | None, as_json: bool) -> None:
    """Does DRAFT (a checkpoint folder or its config.json) make ENGINE feed the fc the spec's points?

    Exit 0 when it does, 3 when it does not, 2 on bad input.
    """
    from surgeon.wiring.draft import check_draft as do_check

    s = load_spec(spec)
    if engine in ("sglang", "vllm", "speculators"):
        _open_with_progress("vllm" if engine == "speculators" else engine, engine_root)
    r = do_check(s, draft, engine, engine_root=engine_root, model_class=model_class)
    if as_json:
        _emit_json(r.to_json())
    else:
        out.print(f"[bold]{escape(r.draft)}[/] on {r.engine}" + (f" ({escape(r.model_class)})" if r.model_class else "") + f" against {escape(r.spec)}")
        out.print(f"  expected fc input: {', '.join(r.expected)}")
        out.print(f"  engine captures:   {', '.join(str(c) for c in r.captured)}")
        style = {"error": "red", "warning": "yellow", "info": "dim"}
        for f in r.findings:
            out.print(f"  [{style[f.severity]}]{f.severity}[/] {f.kind}: {escape(f.detail)}")
        out.print("[green]ok[/]" if r.ok else "[red]mismatch[/]")
    if not r.ok:
        sys.exit(3)


# ---------------------------------------------------------------------------------------------
@main.command()
@click.argument("old", type=click.Path(dir_okay=False))
@click.argument("new", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
def review(old: str, new: str, as_json: bool) -> None:
    """Markdown for a pull-request comment: what each capture physically was and is, and each
    engine's ids before and after."""
    from surgeon.wiring.review import review as do_review

    a, b = load_spec(old), load_spec(new)
    for e in ("sglang", "vllm"):
        _open_with_progress(e, None)
    r = do_review(a, b)
    if as_json:
        _emit_json({**r.data, "markdown": r.markdown})
    else:
        click.echo(r.markdown, nl=False)


# ---------------------------------------------------------------------------------------------
@main.command()
@click.option("--engine", required=True, type=ENGINE_CHOICE)
@click.option("--engine-root", type=click.Path(), help="Engine package directory (default: the installed package, found without importing it).")
@click.option("--json", "as_json", is_flag=True)
@click.option("--all", "show_all", is_flag=True, help="Also list every classified class in the text report.")
def conventions(engine: str, engine_root: str | None, as_json: bool, show_all: bool) -> None:
    """What the installed engine's ids mean, per model class, read from its source."""
    view = _open_with_progress(engine, engine_root)
    if view.probe is None:
        raise BadInput(f"{engine} is not installed here; pass --engine-root DIR (the {engine} package directory)")
    probe = view.probe
    if as_json:
        _emit_json(probe.to_json())
        return
    out.print(f"[bold]{engine} {escape(probe.version)}[/] at {escape(probe.root)}: {probe.files_scanned} model files")
    groups: dict[tuple, list] = {}
    for c in probe.classified:
        key = (c.id_rule.name if c.id_rule else "?", ", ".join(map(str, c.default)) if c.default else "none",
               c.default_through_rule, c.sorts, c.dedups, c.capture_site, c.captured_value)
        groups.setdefault(key, []).append(c)
    table = Table(title="conventions (classes grouped by identical rules)")
    for h in ("id -> capture index", "default", "sorted/dedup", "captured at", "value", "classes"):
        table.add_column(h)
    for (rule, default, through, sorts, dedups, site, value), classes in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        names = sorted(c.class_name for c in classes)
        shown = names if show_all or len(names) <= 6 else names[:6] + [f"... {len(names) - 6} more (--all)"]
        table.add_row(rule, f"{default}{' (through the rule)' if through else ''}",
                      f"{'sorted' if sorts else 'layer order'}/{'dedup' if dedups else 'dups kept'}",
                      f"layer {site}", value, "\n".join(shown))
    out.print(table)
    bypassed = [c for c in probe.classified if c.bypasses]
    for c in bypassed:
        for b in c.bypasses:
            out.print(f"[yellow]bypass[/] {c.class_name} ({escape(b.path or c.path)}:{b.line}): {escape(b.description)} (when: {escape(b.layers)})")
    for c in probe.unclassified:
        tag = "[yellow]no capture[/]" if c.no_capture else "[red]unclassified[/]"
        out.print(f"{tag} {c.class_name} ({escape(c.path)}:{c.line}): {escape(c.reason or '')}")
    cov = probe.coverage()
    for group, n in cov.items():
        out.print(f"{group}: {n['total']} classes, {n['classified']} classified, {n['no_capture']} shown by the source not to capture, "
                  f"{n['unclassified']} unclassified")


# ---------------------------------------------------------------------------------------------
# the wiring harness
# ---------------------------------------------------------------------------------------------
@main.command()
@click.argument("model", type=click.Path(file_okay=False))
@click.option("--input-ids", required=True, help="Token ids to run, comma- or space-separated.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Reference file to write (safetensors).")
def reference(model: str, input_ids: str, output: str) -> None:
    """Run an HF model folder on INPUT_IDS and record every physical point (embed, each
    layer_out and layer_delta, final_norm) into a reference file."""
    from surgeon.verify.harness import parse_input_ids
    from surgeon.verify.reference import capture_reference, save_reference

    with _progress("running the HF reference") as bar:
        bar.add_task("ref", total=None)
        ref = capture_reference(model, parse_input_ids(input_ids))
    save_reference(ref, output)
    out.print(f"wrote {escape(output)}: {len(ref.states)} points x {ref.input_ids.numel()} tokens, L={ref.num_layers}, H={ref.hidden_size}")


@main.command()
@click.argument("ref")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
@click.option("--input-ids", help="Token ids, for an hf:DIR reference.")
@click.option("--dim", default=64, show_default=True, help="Random projection width.")
@click.option("--seed", default=0, show_default=True)
def fingerprint(ref: str, output: str, input_ids: str | None, dim: int, seed: int) -> None:
    """Write a small fingerprint of REF (hf:DIR or a reference file) that identification can use
    instead of the full tensors: keep it next to the spec."""
    from surgeon.verify.fingerprint import Fingerprint, fingerprint as make_fp, fingerprint_file, save_fingerprint
    from surgeon.verify.harness import load_reference_arg, parse_input_ids

    if dim < 8 or dim > 4096:
        raise BadInput("--dim must be between 8 and 4096")
    if not ref.startswith("hf:") and Path(ref).is_file():
        fp = fingerprint_file(ref, dim=dim, seed=seed)
    else:
        r = load_reference_arg(ref, parse_input_ids(input_ids))
        fp = r if isinstance(r, Fingerprint) else make_fp(r, dim=dim, seed=seed)
    save_fingerprint(fp, output)
    out.print(f"wrote {escape(output)}: {len(fp.proj)} points x {fp.input_ids.numel()} tokens, dim {fp.dim}, seed {fp.seed}")


def _print_match(result, *, verbose: bool = True) -> None:
    table = Table()
    for h in ("slot", "declared", "matched", "rel err", "margin", "verdict"):
        table.add_column(h)
    style = {"ok": "green", "mismatch": "red", "no_match": "red", "unlabelled": "yellow"}
    for s in result.report.slots:
        table.add_row(s.name, str(s.declared or "-"), str(s.matched or "none"), f"{s.rel_err:.4f}",
                      f"{s.margin:.1f}x", f"[{style.get(s.verdict, 'white')}]{s.verdict}[/]")
    out.print(f"{escape(result.subject.source)} ({result.subject.layout}) vs {escape(str(result.reference_source))}; tokens: {escape(result.alignment)}")
    out.print(table)
    for d in result.report.diagnosis:
        out.print(f"[red]{d.kind}[/]: {escape(d.detail)}")
    if result.report.suggested_captures and not result.ok:
        out.print("suggested captures: " + ", ".join(f"{k}: {v}" for k, v in result.report.suggested_captures.items()))
    for engine, ids in result.engine_ids.items():
        out.print(f"  {engine} ids: {escape(str(ids))}")
    for n in result.notes:
        out.print(f"[dim]note: {escape(n)}[/]")


def _run_match(subject, ref, spec, slots, input_ids, as_json: bool, plot: str | None):
    from surgeon.verify.harness import match as do_match, plot_heatmap

    result = do_match(subject, ref, spec=spec, slots=slots, input_ids=input_ids)
    if plot:
        plot_heatmap(result, plot)
    if as_json:
        _emit_json(result.to_json())
    else:
        _print_match(result)
    return result


def _harness_options(f):
    f = click.option("--slots", multiple=True, help="Name the subject's slots in order: name, point, or name=point (comma-separated or repeated).")(f)
    f = click.option("--input-ids", help="Token ids of the subject, when the file carries none.")(f)
    f = click.option("--json", "as_json", is_flag=True)(f)
    f = click.option("--plot", type=click.Path(dir_okay=False), help="Write the slots x points heatmap to this PNG.")(f)
    return f


@main.command()
@click.argument("subject", type=click.Path(dir_okay=False))
@click.option("--reference", "ref", required=True, help="hf:DIR, a reference file, or a fingerprint file.")
@click.option("--spec", type=click.Path(dir_okay=False), help="Spec declaring the slots (its dump slots, in order).")
@_harness_options
def match(subject: str, ref: str, spec: str | None, slots: tuple[str, ...], input_ids: str | None, as_json: bool, plot: str | None) -> None:
    """Which physical point each slot of SUBJECT really is, how sure, and what is wrong."""
    _run_match(subject, ref, load_spec(spec) if spec else None, slots, input_ids, as_json, plot)
    if not as_json and plot:
        out.print(f"heatmap: {escape(plot)}")


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--subject", required=True, type=click.Path(dir_okay=False))
@click.option("--reference", "ref", required=True, help="hf:DIR, a reference file, or a fingerprint file.")
@_harness_options
def verify(spec: str, subject: str, ref: str, slots: tuple[str, ...], input_ids: str | None, as_json: bool, plot: str | None) -> None:
    """Exit 0 when every slot of SUBJECT is what SPEC declares, 3 when not, 2 on bad input."""
    result = _run_match(subject, ref, load_spec(spec), slots, input_ids, as_json, plot)
    if not as_json:
        out.print("[green]wiring verified[/]" if result.ok else "[red]wiring differs from the spec[/]")
    if not result.ok:
        sys.exit(3)


@main.command("sweep-spec")
@click.option("--name", required=True)
@click.option("--architecture", required=True)
@click.option("--num-layers", required=True, type=click.IntRange(1, 100000))
@click.option("--hidden-size", required=True, type=click.IntRange(1, 10**7))
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write here instead of stdout (refuses to overwrite).")
def sweep_spec(name: str, architecture: str, num_layers: int, hidden_size: int, output: str | None) -> None:
    """A spec capturing every point (embed, each layer_out, final_norm): an engine's dump of it is a
    reference where HF cannot run the model."""
    from surgeon.core.spec import sweep_spec_text

    _write_new_or_stdout(sweep_spec_text(name, architecture, num_layers, hidden_size), output)


@main.command("dump-info")
@click.argument("dump", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
def dump_info(dump: str, as_json: bool) -> None:
    """What a surgeon dump says it is: spec, engine, model, and each capture's physical point."""
    from surgeon.capture.dumps import read_dump

    d = read_dump(dump, load=False)
    info = {"file": dump, **{k: v for k, v in d.meta.items() if k != "captures"},
            "captures": [{"name": n, "point": str(p), "shape": d.shapes.get(n)} for n, p, _ in d.captures]}
    if as_json:
        _emit_json(info)
        return
    out.print(f"[bold]{escape(dump)}[/]: spec {escape(d.meta.get('spec.name') or '-')} (sha256 {d.meta.get('spec.sha256', '')[:12] or '-'}), "
              f"{escape(d.meta.get('engine') or '?')} {escape(d.meta.get('engine.version', ''))}, model {escape(d.meta.get('model') or '?')}, "
              f"{d.meta.get('tokens')} tokens, {d.meta.get('dtype')}")
    for c in info["captures"]:
        out.print(f"  {c['name']}: {c['point']} {c['shape']}")


@main.command()
@click.argument("dumps", nargs=-1, required=True, type=click.Path())
@click.option("--spec", "spec_path", required=True, type=click.Path(dir_okay=False), help="The spec the dumps were taken with.")
@click.option("--layout", required=True, type=click.Choice(["specforge", "speculators"]))
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write the exported files into.")
@click.option("--json", "as_json", is_flag=True)
def export(dumps: tuple[str, ...], spec_path: str, layout: str, out_dir: str, as_json: bool) -> None:
    """Export surgeon dumps (files or shard folders) to a training tool's layout, keeping its own
    semantics (SpecForge's hidden_state is final_norm; speculators' last slot is layer_out[L-1],
    pre-norm), or refuse when the dumps cannot fill it truthfully."""
    from surgeon.capture.exporters import export_specforge, export_speculators

    spec = load_spec(spec_path)
    fn = export_specforge if layout == "specforge" else export_speculators
    written = fn(list(dumps), out_dir, spec=spec)
    if as_json:
        _emit_json({"layout": layout, "written": [str(p) for p in written]})
    else:
        out.print(f"wrote {len(written)} {layout} file(s) to {escape(out_dir)}")


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--mode", required=True, type=click.Choice(["aux", "dump"]), help="aux: hand the fc captures to the draft; dump: keep them for drain().")
@click.option("--max-tokens", required=True, type=click.IntRange(1, 1 << 24), help="The engine's maximum tokens per step (buffer rows).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the module here (refuses to overwrite); default stdout.")
def hooks(spec: str, mode: str, max_tokens: int, output: str | None) -> None:
    """Generate the CUDA-graph-safe capture hooks module for SPEC (checked before it is written)."""
    from surgeon.capture.graphsafe import check_source
    from surgeon.capture.hooks import generate_hooks_module

    source = generate_hooks_module(load_spec(spec), mode=mode, max_tokens=max_tokens)
    findings = check_source(source, "<generated>")
    if findings:  # the generator's own contract: never hand out unsafe code
        raise RuntimeError(f"generated hooks fail the graph-safety check: {findings[0]}")
    _write_new_or_stdout(source, output)


@main.command("check-hooks")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
def check_hooks(files: tuple[str, ...], as_json: bool) -> None:
    """Static graph-safety check of hook code: host syncs (.item, .cpu, .tolist), printing,
    torch.save and other I/O, per-step allocation, branches on tensor values. Exit 3 on findings."""
    from surgeon.capture.graphsafe import check_file

    findings = []
    for f in files:
        try:
            findings += check_file(f)
        except (OSError, UnicodeDecodeError) as e:
            raise BadInput(f"{f}: cannot read as UTF-8 text: {getattr(e, 'strerror', None) or e}") from None
    if as_json:
        _emit_json({"ok": not findings, "findings": [x.to_json() for x in findings]})
    else:
        for x in findings:
            click.echo(str(x))
        if not findings:
            click.echo(f"{len(files)} file(s): no graph-unsafe operations")
    if findings:
        sys.exit(3)


# --------------------------------------------------------------------------------------------- patches
def _engines_with_patches(engine: str | None, engine_root: str | None) -> list[tuple[str, Any]]:
    """(engine, PatchManager) for --engine, else for every installed engine."""
    from surgeon.patch.apply import manager_for

    if engine_root and not engine:
        raise BadInput("--engine-root needs --engine")
    if engine:
        return [(engine, manager_for(engine, engine_root))]
    found = []
    for e in ("sglang", "vllm"):
        try:
            found.append((e, manager_for(e)))
        except BadInput:
            continue  # not installed here
    if not found:
        raise BadInput("neither sglang nor vllm is installed here; pass --engine and --engine-root")
    return found


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--engine", required=True, type=ENGINE_CHOICE)
@click.option("--engine-root", type=click.Path(), help="Engine package directory (default: the installed package, found without importing it).")
@click.option("--mode", default="dump", show_default=True, type=click.Choice(["dump", "aux"]), help="dump: keep the captures for a drain after each step; aux: also hand the spec's fc input, in fc order, to the engine's draft path where the forward returns aux_hidden_states.")
@click.option("--max-tokens", default=DEFAULT_MAX_TOKENS, show_default=True, type=click.IntRange(1, 1 << 24), help="The engine's maximum tokens per forward step (capture buffer rows).")
@click.option("--model-file", help="Model file to patch, relative to the engine root (default: where the probe finds the model class's decoder loop, else the spec's pinned model_file).")
@click.option("--loop-class", help="The class whose forward holds the decoder-layer loop (default: the probe's, else the file's only one).")
@click.option("--name", help="Patch name (default: the spec's name).")
@click.option("--dry-run", is_flag=True, help="Show what would change; write nothing.")
@click.option("--diff", "show_diff", is_flag=True, help="Print the unified diff of the change.")
@click.option("--replace", is_flag=True, help="Revert a patch already on these files first (in the same transaction).")
@click.option("--guard-bypass", is_flag=True, help="Where decoder layers can run outside the capture loop (SGLang two-batch overlap), insert a runtime guard that raises if a captured layer would run there, instead of refusing.")
@click.option("--json", "as_json", is_flag=True)
def apply(spec: str, engine: str, engine_root: str | None, mode: str, max_tokens: int, model_file: str | None,
          loop_class: str | None, name: str | None, dry_run: bool, show_diff: bool, replace: bool,
          guard_bypass: bool, as_json: bool) -> None:
    """Put SPEC's captures into the engine's real model file, with a generated hooks module next to it.

    One journaled transaction: each file ends either original or fully patched; `surgeon revert`
    gives back the exact original bytes.
    """
    from surgeon.patch.apply import apply_spec

    s = load_spec(spec)
    if not model_file:
        _open_with_progress(engine, engine_root)  # the probe finds the loop's file: show its progress
    with _spinner("rewriting and applying", as_json):
        outcome = apply_spec(s, engine=engine, engine_root=engine_root, mode=mode, max_tokens=max_tokens,
                             model_file=model_file, loop_class=loop_class, name=name, dry_run=dry_run,
                             diff=show_diff, replace=replace, guard_bypass=guard_bypass)
    if as_json:
        _emit_json(outcome.to_json())
        return
    p = outcome.plan
    if outcome.diff is not None:
        click.echo(outcome.diff, nl=False)
    if outcome.result is not None and outcome.result.recovered:
        err.print(f"recovered first: {escape(outcome.result.recovered)}")
    where = f"{p.engine} {p.engine_version} at {p.engine_root}"
    if dry_run:
        out.print(f"dry run: patch {escape(p.name)} would change {escape(p.model_file)} "
                  f"({len(p.anchors)} insertions) and create {escape(p.hooks_file)} in {escape(where)}; nothing written")
    elif outcome.result is not None and not outcome.result.changed:
        out.print(f"patch {escape(p.name)} is already applied to {escape(p.model_file)} in {escape(where)}; nothing to do")
    else:
        replaced = f" (replaced {', '.join(outcome.result.replaced)})" if outcome.result and outcome.result.replaced else ""
        out.print(f"applied patch {escape(p.name)}{escape(replaced)}: {escape(p.model_file)} "
                  f"[{escape(p.loop_class or 'its decoder loop')}, recipe {escape(p.recipe)}] "
                  f"and {escape(p.hooks_file)} in {escape(where)}")
    for a in p.anchors:
        out.print(f"  {escape(a)}")


def _spinner(text: str, as_json: bool):
    """A rich spinner on a terminal; nothing under --json or in a log."""
    return err.status(text, spinner="dots") if err.is_terminal and not as_json else contextlib.nullcontext()


@main.command()
@click.argument("name", required=False)
@click.option("--all", "all_", is_flag=True, help="Revert every patch.")
@click.option("--force", is_flag=True, help="Drop files changed since apply (drift) from the manifest, leaving them alone.")
@click.option("--engine", type=ENGINE_CHOICE, help="Default: every installed engine holding patches.")
@click.option("--engine-root", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def revert(name: str | None, all_: bool, force: bool, engine: str | None, engine_root: str | None, as_json: bool) -> None:
    """Restore the byte-identical originals of patch NAME (or the only patch, or --all)."""
    if name and all_:
        raise BadInput("give a patch NAME or --all, not both")
    managers = _engines_with_patches(engine, engine_root)
    applied = {e: [p.name for p in m.status()] for e, m in managers}
    if name:
        holders = [(e, m) for e, m in managers if name in applied[e]]
        if not holders:
            raise BadInput(f"{name}: no such patch applied ({_applied_summary(applied)})")
        managers = holders
    elif not all_:
        managers = [(e, m) for e, m in managers if applied[e]]
        if not managers:
            raise BadInput(f"no surgeon patches applied ({_applied_summary(applied)})")
        if len(managers) > 1 or len(applied[managers[0][0]]) > 1:
            raise BadInput(f"several patches applied ({_applied_summary(applied)}); name one or pass --all")
    report = []
    for e, m in managers:
        if all_ and not applied[e]:
            continue
        r = m.revert(name, all=all_, force=force)
        report.append({"engine": e, "engine_root": str(m.root), "reverted": r.reverted, "restored": r.restored,
                       "warnings": r.warnings, "recovered": r.recovered})
    if as_json:
        _emit_json({"reverted": report})
        return
    if not report:
        out.print("no surgeon patches applied; nothing to revert")
    for r in report:
        if r["recovered"]:
            err.print(f"recovered first: {escape(r['recovered'])}")
        out.print(f"reverted {escape(', '.join(r['reverted']))} in {r['engine']} at {escape(r['engine_root'])}: "
                  f"{len(r['restored'])} file(s) restored byte-identical")
        for w in r["warnings"]:
            err.print(f"warning: {escape(w)}")


def _applied_summary(applied: dict[str, list[str]]) -> str:
    return "; ".join(f"{e}: {', '.join(v) if v else 'none'}" for e, v in applied.items())


@main.command()
@click.option("--engine", type=ENGINE_CHOICE, help="Default: every installed engine.")
@click.option("--engine-root", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def status(engine: str | None, engine_root: str | None, as_json: bool) -> None:
    """What surgeon has patched in each engine, and whether every file is still as patched.

    Exit 3 when a patched file drifted (an engine upgrade, a hand edit) or went missing."""
    rows = []
    for e, m in _engines_with_patches(engine, engine_root):
        for p in m.status():
            rows.append((e, m.root, p))
    bad = any(p.state != "applied" for _, _, p in rows)
    if as_json:
        _emit_json({"ok": not bad, "patches": [
            {"engine": e, "engine_root": str(root), "name": p.name, "state": p.state,
             "spec": {"name": p.spec_name, "sha256": p.spec_sha256},
             "engine_version": p.engine_version, "created": p.created,
             "files": [{"relpath": f.relpath, "state": f.state, "created": f.sha256_before == ABSENT,
                        "sha256_before": f.sha256_before, "sha256_after": f.sha256_after} for f in p.files]}
            for e, root, p in rows]})
    elif not rows:
        out.print("no surgeon patches applied")
    else:
        table = Table("engine", "patch", "spec", "state", "file", "file state")
        for e, root, p in rows:
            for i, f in enumerate(p.files):
                style = "" if f.state == "applied" else "bold red"
                what = f"{f.relpath} (created)" if f.sha256_before == ABSENT else f.relpath
                table.add_row(f"{e} {p.engine_version}" if i == 0 else "", p.name if i == 0 else "",
                              f"{p.spec_name} {p.spec_sha256[:12]}" if i == 0 else "",
                              p.state if i == 0 else "", escape(what), f"[{style}]{f.state}[/]" if style else f.state)
        out.print(table)
    if bad:
        sys.exit(3)


@main.command()
@click.argument("name", required=False)
@click.option("--engine", type=ENGINE_CHOICE, help="Default: every installed engine.")
@click.option("--engine-root", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def diff(name: str | None, engine: str | None, engine_root: str | None, as_json: bool) -> None:
    """The unified diff (original -> patched) of patch NAME, or of every patch, from the stored
    originals and patched bytes (exit 2 when there is no such patch)."""
    found = []
    for e, m in _engines_with_patches(engine, engine_root):
        for p in m.status():
            if name is None or p.name == name:
                found.append((e, p, m.diff(p.name)))
    if not found:
        raise BadInput(f"{name}: no such patch applied" if name else "no surgeon patches applied")
    if as_json:
        _emit_json({"patches": [{"engine": e, "name": p.name, "state": p.state,
                                 "files": [{"relpath": f.relpath, "created": f.sha256_before == ABSENT,
                                            "state": f.state} for f in p.files], "diff": text}
                                for e, p, text in found]})
        return
    click.echo("".join(text for _, _, text in found), nl=False)


@main.command()
@click.option("--engine", required=True, type=ENGINE_CHOICE)
@click.option("--engine-root", type=click.Path())
@click.option("--jobs", type=click.IntRange(1, 64), help="Worker processes (default: 2).")
@click.option("--all", "show_all", is_flag=True, help="List every loop-owning class, not only the ones that cannot be patched.")
@click.option("--json", "as_json", is_flag=True)
def coverage(engine: str, engine_root: str | None, jobs: int | None, show_all: bool, as_json: bool) -> None:
    """For every model file and class with a decoder-layer loop: can surgeon patch it, does the engine
    capture natively, and why not when it cannot."""
    from surgeon.patch.coverage import coverage as run_coverage, render_coverage_lines

    with _spinner(f"reading {engine} model files", as_json):
        report = run_coverage(engine, Path(engine_root) if engine_root else None, jobs=jobs)
    if as_json:
        _emit_json(report.to_json())
    else:
        for line in render_coverage_lines(report, all_classes=show_all):
            click.echo(line)


# --------------------------------------------------------------------------------------------- demo
@main.command()
@click.option("--workdir", type=click.Path(file_okay=False), help="New folder for everything the demo writes (default: ./surgeon-demo-<time>).")
@click.option("--engine-root", type=click.Path(), help="The vLLM package directory to patch (default: the installed one).")
@click.option("--json", "as_json", is_flag=True)
def demo(workdir: str | None, engine_root: str | None, as_json: bool) -> None:
    """The whole loop on the real vLLM engine with a tiny model made here: apply the demo spec,
    run, verify the dump, catch a mis-wired variant (heatmap PNG), revert byte-identically."""
    import time

    from surgeon.run.demo import run_demo

    work = Path(workdir) if workdir else Path.cwd() / time.strftime("surgeon-demo-%Y%m%d-%H%M%S")
    started = time.perf_counter()
    n = [0]
    status = _spinner("", as_json)
    with status:
        def step(title: str) -> None:
            n[0] += 1
            line = f"[{n[0]}/7] {title}"
            if hasattr(status, "update"):
                status.update(escape(line))
            err.print(f"[bold]{escape(line)}[/]  [dim]{time.perf_counter() - started:5.1f} s[/]")

        def note(text: str) -> None:
            err.print(f"      {escape(text)}")

        result = run_demo(work, step=step, note=note, engine_root=engine_root)
    if as_json:
        _emit_json(result.to_json())
    else:
        out.print("\n[bold]the spec's wiring[/] (what vLLM captured, checked against the HF reference):")
        _print_match(result.right)
        out.print("\n[bold]a mis-wired variant[/] (the same dump, labelled as the Kimi-K2.5 dumps were):")
        _print_match(result.wrong)
        out.print("")
        rows = [("work folder", result.workdir), ("tiny model", result.model), ("spec", result.spec),
                ("mis-wired spec", result.wrong_spec), ("HF reference", result.reference), ("vLLM dump", result.dump),
                ("heatmap (mis-wired)", result.heatmap), ("heatmap (right)", result.heatmap_right),
                ("patched, then reverted", result.engine_root / result.model_file)]
        table = Table("what", "where", show_header=False)
        for what, where in rows:
            table.add_row(what, escape(str(where)))
        out.print(table)
        out.print(f"model file reverted byte-identical: {result.reverted_identical}; "
                  f"total {time.perf_counter() - started:.0f} s")
    if not result.reverted_identical:
        raise RuntimeError(f"{result.engine_root / result.model_file} is not byte-identical after the revert")
    if not result.right.ok or result.wrong.ok:
        raise Mismatch("the demo's wiring check did not come out as expected (see above): "
                       + ("the spec's wiring failed verify" if not result.right.ok else "the mis-wiring was not caught"))
    if not as_json:
        out.print("[green]demo ok[/]: the wiring is proven on the real engine, and the mis-wiring is named slot by slot")
