"""Commands on specs and drafts: schema, lint, explain, render, check-draft, review, conventions,
sweep-spec. Each loads what it is given, probes the engines it needs (with progress) and returns
the library's report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from surgeon.commands.platform import engine_command
from surgeon.commands.progress import QUIET, Progress, open_engines
from surgeon.commands.results import GeneratedText, write_new_file
from surgeon.core.errors import BadInput
from surgeon.core.shapes import Reads

ENGINES = ("sglang", "vllm")


def engine_roots(engine: str | None, engine_root: str | None) -> dict[str, str | None]:
    """``--engine-root`` belongs to the ``--engine`` it is given with."""
    if engine_root and not engine:
        raise BadInput("--engine-root needs --engine")
    return {engine: engine_root} if engine and engine_root else {}


def schema(*, output: str = "spec") -> SchemaResult:
    """A JSON Schema: of spec v1 (``output="spec"``), or of the ``--json`` output of the command
    ``output`` (one of :data:`surgeon.commands.outputs.FORMATS`)."""
    if output == "spec":
        from surgeon.core.spec import json_schema

        return SchemaResult(json_schema())
    from surgeon.commands.outputs import output_schema

    return SchemaResult(output_schema(output))


@engine_command
def lint(*, specs: Sequence[str], engines: Sequence[str] = (), engine_root: str | None = None,
         strict: bool = False, platform: str | None = None, progress: Progress = QUIET,
         skip_non_specs: bool = False, pp: int | None = None, tp: int = 1) -> LintReport:
    """Validate ``specs`` and check each engine can feed the draft what they declare: whatever
    ``render`` refuses for an engine is an error (exit 2). ``strict``: an answer render gives but
    marks unverified is an error too; ``skip_non_specs``: leave out files without a
    top-level ``spec:`` key (other YAML); ``pp``/``tp``: also place each capture on its pipeline
    stage and check it reaches the draft (:mod:`surgeon.engines.probes.pipeline`)."""
    from surgeon.core.spec import is_spec_file
    from surgeon.wiring.lint import lint_files

    if skip_non_specs:
        specs = [s for s in specs if is_spec_file(s)]

    if engine_root and len(engines) != 1:
        raise BadInput("--engine-root needs exactly one --engine")
    roots: dict[str, str | None] = {engines[0]: engine_root} if engine_root else {}
    open_engines(sorted(set(engines) or set(ENGINES)), roots, progress)
    return LintReport(lint_files(specs, engines=tuple(engines), roots=roots, strict=strict, pp=pp, tp=tp))


@engine_command
def explain(*, spec: str, engine: str | None = None, engine_root: str | None = None,
            model_class: str | None = None, platform: str | None = None, progress: Progress = QUIET) -> Any:
    """Per capture: its point, every convention's id (or why none), fc slot and dump slot."""
    from surgeon.core.spec import load_spec
    from surgeon.wiring.render import explain as explain_spec

    s = load_spec(spec)
    roots = engine_roots(engine, engine_root)
    open_engines(ENGINES, roots, progress)
    return explain_spec(s, roots=roots, model_classes={engine: model_class} if engine and model_class else {})


@engine_command
def render(*, spec: str, target: str, engine_root: str | None = None, model_class: str | None = None,
           pin: bool = False, platform: str | None = None, progress: Progress = QUIET) -> RenderReport:
    """The draft-config fragment and launch flags for ``target``; ``pin`` also writes the
    installed engine's pins into the spec file."""
    from surgeon.core.spec import load_spec
    from surgeon.wiring.render import ENGINE_FOR
    from surgeon.wiring.render import render as render_spec

    s = load_spec(spec)
    engine = ENGINE_FOR.get(target)
    if engine:
        open_engines([engine], {engine: engine_root}, progress)
    if pin and target not in ENGINES:
        raise BadInput("--pin needs --engine sglang or vllm")
    report = RenderReport(render_spec(s, target, engine_root=engine_root, model_class=model_class))
    if pin:
        from surgeon.wiring.pins import pin_values, write_pins

        report.pinned = pin_values(s, target, engine_root=engine_root, model_class=model_class)
        write_pins(spec, target, report.pinned)
    return report


@engine_command
def check_draft(*, spec: str, draft: str, engine: str, engine_root: str | None = None,
                model_class: str | None = None, platform: str | None = None,
                progress: Progress = QUIET) -> DraftVerdict:
    """Does ``draft`` make ``engine`` feed the fc the spec's points? Not: a mismatch (exit 3)."""
    from surgeon.core.spec import load_spec
    from surgeon.wiring.draft import check_draft as check

    s = load_spec(spec)
    if engine in ("sglang", "vllm", "speculators"):
        probed = "vllm" if engine == "speculators" else engine
        open_engines([probed], {probed: engine_root}, progress)
    return DraftVerdict(check(s, draft, engine, engine_root=engine_root, model_class=model_class))


@engine_command
def review(*, old: str, new: str, platform: str | None = None, progress: Progress = QUIET) -> ReviewReport:
    """Markdown for a pull-request comment on the change from spec ``old`` to spec ``new``."""
    from surgeon.core.spec import load_spec
    from surgeon.wiring.review import review as review_specs

    a, b = load_spec(old), load_spec(new)
    open_engines(ENGINES, {}, progress)
    return ReviewReport(review_specs(a, b))


@engine_command
def conventions(*, engine: str, engine_root: str | None = None, platform: str | None = None,
                progress: Progress = QUIET) -> Any:
    """The installed engine's probe: what its ids mean, per model class, read from its source."""
    from surgeon.engines.view import open_engine

    open_engines([engine], {engine: engine_root}, progress)
    view = open_engine(engine, engine_root)
    if view.probe is None:
        raise BadInput(f"{engine} is not installed here; pass --engine-root DIR (the {engine} package directory)")
    return view.probe


def sweep_spec(*, name: str, architecture: str, num_layers: int, hidden_size: int,
               output: str | None = None) -> GeneratedText:
    """A spec capturing every point, written to the new file ``output`` or returned to print."""
    from surgeon.core.spec import sweep_spec_text

    return write_new_file(sweep_spec_text(name, architecture, num_layers, hidden_size), output)


@dataclass
class SchemaResult:
    """A JSON Schema; ``surgeon schema`` prints ``schema`` itself (a schema has no output model)."""

    schema: dict


@dataclass
class LintReport:
    """Every linted spec; invalid specs are bad input (exit 2), warnings are not."""

    results: list[Any]  # surgeon.wiring.lint.LintResult, in argument order

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 2

    specs = Reads("results")


@dataclass
class RenderReport:
    """A rendering; ``--json`` reports it (``reported``), not the pins written with ``--pin``."""

    rendering: Any  # surgeon.wiring.render.Rendering
    pinned: dict | None = None  # the engines.<engine> values written into the spec (--pin)

    reported = Reads("rendering")


@dataclass
class DraftVerdict:
    """A draft checked against a spec: a draft the engine would feed wrongly is a mismatch."""

    report: Any  # surgeon.wiring.draft.DraftReport

    ok = Reads("report.ok")
    reported = Reads("report")

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 3


@dataclass
class ReviewReport:
    review: Any  # surgeon.wiring.review.Review

    markdown = Reads("review.markdown")
    reported = Reads("review")
