"""The `surgeon` command line: click options, progress display, one call into the command layer
(``surgeon.commands``, one function per verb) and a rendering of its result (``surgeon.cli_render``
for text, the output model of ``surgeon.commands.outputs`` for ``--json``).

Exit codes, mapped in one place (:class:`_Group`): 0 fine; 2 bad input (a one-line message per
problem, located where there is a file; nothing written); 3 the checked wiring differs from the
spec; 4 the evidence does not decide (``surgeon.core.errors.UNDECIDED``: match, verify, audit,
infer-wiring, upgrade-check); 1 internal error; 130 interrupted. A command's error carries its code
(``surgeon.core.errors.SurgeonError.exit_code``); a returned report carries its verdict
(``exit_code``), applied after it is rendered.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click
from rich.markup import escape

from surgeon import __version__, commands
from surgeon import cli_render as show
from surgeon.audit.exact import PARAM_TOKENS as EXACT_PARAM_TOKENS
from surgeon.audit.exact import SPOT as EXACT_SPOT
from surgeon.cli_render import RichProgress, emit_json
from surgeon.core.errors import SurgeonError
from surgeon.core.optional import missing_dependency
from surgeon.patch.apply import DEFAULT_MAX_TOKENS

ENGINE_CHOICE = click.Choice(["sglang", "vllm"])
PLATFORM_OPTION = click.option(
    "--platform", type=click.Choice(["cuda", "rocm", "cpu"]), default=None,
    help="The platform the engine answers hold for (vLLM picks some architectures' classes per platform); "
         "default cuda, and a CPU build of vLLM says so.")


class _Group(click.Group):
    """The one place where errors and verdicts become exit codes, without tracebacks."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        """Ctrl-C while the arguments are parsed: one line, exit 130 (click would say "Aborted!", exit 1)."""
        try:
            return super().make_context(info_name, args, parent, **extra)
        except KeyboardInterrupt:
            _say_interrupted()
            raise click.exceptions.Exit(130) from None
        except click.UsageError as e:  # `surgeon --bogus`: one line, exit 2
            _say_usage(e)
            raise click.exceptions.Exit(e.exit_code) from None

    def invoke(self, ctx: click.Context) -> Any:
        """Ctrl-C anywhere in the command, its error handling or its verdict: one line, exit 130."""
        try:
            return self._invoke(ctx)
        except KeyboardInterrupt:
            _say_interrupted()
            ctx.exit(130)

    def _invoke(self, ctx: click.Context) -> Any:
        try:
            result = super().invoke(ctx)
            sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        except click.UsageError as e:  # a bad argument or option: one line, not click's usage block
            _say_usage(e)
            ctx.exit(e.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except BrokenPipeError:  # `surgeon explain ... | head`: the reader has what it wanted
            _drop_stdout()
            ctx.exit(0)
        except SystemExit as e:  # rich's Console turns a broken pipe into SystemExit(1)
            if not isinstance(e.__context__, BrokenPipeError):
                raise
            _drop_stdout()
            ctx.exit(0)
        except SurgeonError as e:
            for line in e.report_lines():
                click.echo(line, err=True)
            ctx.exit(e.exit_code)
        except Exception as e:  # internal error: one line, unless asked for the traceback
            if (missing := missing_dependency(e)) is not None:  # an optional extra not installed: bad input
                click.echo(f"surgeon: {missing}", err=True)
                ctx.exit(missing.exit_code)
            if os.environ.get("SURGEON_DEBUG"):
                raise
            click.echo(f"surgeon: internal error: {type(e).__name__}: {e} (SURGEON_DEBUG=1 shows the traceback)", err=True)
            ctx.exit(1)
        problem = getattr(result, "problem", None)
        if problem:
            click.echo(f"surgeon: {problem}", err=True)
        code = commands.exit_code_of(result)
        if code:
            ctx.exit(code)
        return result


_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2: `surgeon` alone


def _say_usage(e: click.UsageError) -> None:
    """Click's usage error as one line (click prints the usage, a hint and the error on four): the
    error, then where the help is. A command run without its arguments shows its help, as click does."""
    if isinstance(e, _NO_ARGS_IS_HELP):
        e.show()
        return
    message = " ".join(line.strip() for line in e.format_message().splitlines() if line.strip())
    where = f" (`{e.ctx.command_path} -h` for help)" if e.ctx is not None else ""
    click.echo(f"surgeon: {message}{where}", err=True)


def _say_interrupted() -> None:
    """The one line of an interrupted run (said again if a second Ctrl-C cuts it short)."""
    for _ in range(3):
        try:
            click.echo("surgeon: interrupted", err=True)
            return
        except KeyboardInterrupt:
            continue


def _drop_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush into the closed pipe is
    silent (what the Python docs recommend for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor behind stdout (a test runner)
        pass


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="surgeon")
def main() -> None:
    """Declarative hidden-state wiring for speculative-decoding drafts.

    A spec names, in physical terms (embed, layer_out[k], final_norm), what a draft's fc reads;
    surgeon translates it to every engine's ids, checks drafts and engines against it, and
    explains changes to reviewers.
    """


def _show(result: Any, as_json: bool, print_text: Any) -> Any:
    """Render ``result`` (its JSON under the verb's format number, or ``print_text(result)``) and
    hand it back for the exit code."""
    if as_json:
        emit_json(commands.json_output(click.get_current_context().info_name or "", result))
    else:
        print_text(result)
    return result


# --------------------------------------------------------------------------------------------- specs
@main.command()
@click.option("--output", "output", default="spec", show_default=True, type=click.Choice(["spec", *commands.FORMATS]),
              help="spec: the spec v1 file format; a command name: the shape of that command's --json output.")
def schema(output: str) -> Any:
    """Print a JSON Schema: of spec v1 (for editors' completion and validation), or of a command's
    --json output (its "format" number included)."""
    result = commands.schema(output=output)
    emit_json(result.schema)
    return result


@main.command()
@click.argument("specs", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--engine", "engines", multiple=True, type=ENGINE_CHOICE,
              help="Check this engine (repeatable; default: the spec's engines section, else all).")
@click.option("--engine-root", type=click.Path(), help="Engine package directory to probe (with a single --engine).")
@click.option("--strict", is_flag=True,
              help="Also an error: an answer render gives but marks unverified (a capture site or runner not read "
                   "to the end, a pipeline not checked, an MTP input not decided). What render refuses is always one.")
@click.option("--pp", type=click.IntRange(min=1), default=None,
              help="Pipeline stages: which stage captures each fc point, and whether it reaches the draft.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size (with --pp).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@PLATFORM_OPTION
@click.option("--skip-non-specs", is_flag=True,
              help="Leave out files without a top-level `spec:` key (other YAML; the pre-commit hooks pass every YAML file).")
def lint(specs: tuple[str, ...], engines: tuple[str, ...], engine_root: str | None, strict: bool, pp: int | None,
         tp: int, as_json: bool, platform: str | None, skip_non_specs: bool) -> Any:
    """Validate specs, and check each engine can feed the draft exactly what they declare.

    Exit 0 when every spec is clean (warnings allowed), 2 when any has an error: whatever render
    refuses for an engine is one; with --strict an answer render marks unverified is one too.
    """
    report = commands.lint(specs=specs, engines=engines, engine_root=engine_root, strict=strict, platform=platform,
                           progress=RichProgress(), skip_non_specs=skip_non_specs, pp=pp, tp=tp)
    return _show(report, as_json, show.print_lint)


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--engine", type=ENGINE_CHOICE, help="Engine whose --engine-root / --model-class are given.")
@click.option("--engine-root", type=click.Path(), help="Engine package directory to probe.")
@click.option("--model-class", help="Engine model class (default: the spec's pin, else target.architecture).")
@click.option("--json", "as_json", is_flag=True)
@PLATFORM_OPTION
def explain(spec: str, engine: str | None, engine_root: str | None, model_class: str | None, as_json: bool,
            platform: str | None) -> Any:
    """Per capture: its point, every convention's id (or why none), fc slot and dump slot."""
    ex = commands.explain(spec=spec, engine=engine, engine_root=engine_root, model_class=model_class,
                          platform=platform, progress=RichProgress())
    return _show(ex, as_json, show.print_explanation)


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--engine", "target", required=True, type=click.Choice(
    ["sglang", "vllm", "specforge", "speculators", "trtllm", "modelopt-hf", "modelopt-trtllm", "modelopt-vllm", "zlab"]),
              help="An engine, a trainer, or a cited-table target (trtllm, modelopt-hf|trtllm|vllm, zlab).")
@click.option("--engine-root", type=click.Path(), help="Engine package directory to probe.")
@click.option("--model-class", help="Engine model class (default: the spec's pin, else target.architecture).")
@click.option("--pin", is_flag=True,
              help="Write engines.<engine> pins for the installed engine into SPEC (comments and order kept).")
@click.option("--json", "as_json", is_flag=True)
@PLATFORM_OPTION
def render(spec: str, target: str, engine_root: str | None, model_class: str | None, pin: bool, as_json: bool,
           platform: str | None) -> Any:
    """The draft-config fragment and launch flags for an engine or training tool."""
    report = commands.render(spec=spec, target=target, engine_root=engine_root, model_class=model_class,
                             pin=pin, platform=platform, progress=RichProgress())
    if report.pinned is not None:
        show.err.print(f"pinned engines.{target} in {escape(spec)}: {escape(str(report.pinned))}")
    return _show(report, as_json, lambda r: show.print_rendering(r.rendering))


@main.command("check-draft")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.argument("draft", type=click.Path())
@click.option("--engine", required=True, type=click.Choice(["sglang", "vllm", "specforge", "speculators"]))
@click.option("--engine-root", type=click.Path(), help="Engine package directory to probe.")
@click.option("--model-class", help="Engine model class (default: the spec's pin, else target.architecture).")
@click.option("--json", "as_json", is_flag=True)
@PLATFORM_OPTION
def check_draft(spec: str, draft: str, engine: str, engine_root: str | None, model_class: str | None, as_json: bool,
                platform: str | None) -> Any:
    """Does DRAFT (a checkpoint folder or its config.json) make ENGINE feed the fc the spec's points?

    Exit 0 when it does, 3 when it does not, 2 on bad input.
    """
    verdict = commands.check_draft(spec=spec, draft=draft, engine=engine, engine_root=engine_root,
                                   model_class=model_class, platform=platform, progress=RichProgress())
    return _show(verdict, as_json, lambda v: show.print_draft_check(v.report))


@main.command("infer-wiring")
@click.argument("draft", type=click.Path(file_okay=False))
@click.option("--target", required=True, help="The target model: hf:DIR (a local folder) or hf:ORG/NAME from the local HF cache.")
@click.option("--prompts", type=click.Path(dir_okay=False),
              help="Token-id prompts, one per line (default: 4 x 64 seeded random ids).")
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Write the inferred wiring as a spec v1 there (a new file).")
@click.option("--json", "as_json", is_flag=True)
def infer_wiring(draft: str, target: str, prompts: str | None, output: str | None, as_json: bool) -> Any:
    """Which points DRAFT's fc was trained on, read from its weights against TARGET's states: the
    wiring, its margin over the runner-up, each engine's ids, and a check of the ids the draft's
    config states.

    Exit 0, 3 when the config's ids are missing or disagree with a decided wiring, 2 on bad input.
    """
    report = commands.infer_wiring(draft=draft, target=target, prompts=prompts, output=output,
                                   progress=RichProgress(as_json))
    return _show(report, as_json, show.print_inferred_wiring)


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.argument("draft", type=click.Path())
@click.option("--target", required=True, help="The target model: hf:DIR, a folder, or hf:ORG/NAME (local cache).")
@click.option("--prompts", type=click.Path(dir_okay=False),
              help="Prompts, one per line as token ids (default: 32 seeded prompts from the target's vocabulary).")
@click.option("--steps", default=3, show_default=True, type=int, help="Draft tokens per chain (K).")
@click.option("--length", type=int, help="Tokens per prompt after the target's greedy continuation (default 128).")
@click.option("--min", "min_rate", type=float, help="Exit 3 when the spec's position-1 acceptance is below this (0..1).")
@click.option("--json", "as_json", is_flag=True)
def accept(spec: str, draft: str, target: str, prompts: str | None, steps: int, length: int | None,
           min_rate: float | None, as_json: bool) -> Any:
    """Teacher-forced acceptance of DRAFT on its target, for the spec's wiring and the wirings bugs
    produce (slots off by one, engine defaults, norm swaps, reversed, labels shifted).

    Exit 0, 3 when the spec's wiring is below --min, 2 on bad input.
    """
    report = commands.accept(spec=spec, draft=draft, target=target, prompts=prompts, steps=steps, min_rate=min_rate,
                             length=length, progress=RichProgress(as_json))
    return _show(report, as_json, show.print_accept)


@main.command()
@click.argument("old", type=click.Path(dir_okay=False))
@click.argument("new", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
@PLATFORM_OPTION
def review(old: str, new: str, as_json: bool, platform: str | None) -> Any:
    """Markdown for a pull-request comment: what each capture physically was and is, and each
    engine's ids before and after."""
    report = commands.review(old=old, new=new, platform=platform, progress=RichProgress())
    return _show(report, as_json, lambda r: click.echo(r.markdown, nl=False))


@main.command()
@click.option("--engine", required=True, type=ENGINE_CHOICE)
@click.option("--engine-root", type=click.Path(),
              help="Engine package directory (default: the installed package, found without importing it).")
@click.option("--json", "as_json", is_flag=True)
@click.option("--all", "show_all", is_flag=True, help="Also list every classified class in the text report.")
@PLATFORM_OPTION
def conventions(engine: str, engine_root: str | None, as_json: bool, show_all: bool, platform: str | None) -> Any:
    """What the installed engine's ids mean, per model class, read from its source."""
    probe = commands.conventions(engine=engine, engine_root=engine_root, platform=platform,
                                 progress=RichProgress())
    return _show(probe, as_json, lambda p: show.print_conventions(engine, p, show_all))


@main.command("plan")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--engine", required=True, type=click.Choice(["vllm", "sglang", "trtllm"]),
              help="The engine to plan for: its installed release (or --engine-root); trtllm: tables cited from its source.")
@click.option("--engine-root", type=click.Path(file_okay=False), help="Plan for the engine package at this directory.")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline-parallel size to plan for.")
@click.option("--dump-dir", type=click.Path(file_okay=False),
              help="Where the native route writes its files: the launch names it, and the sidecar that labels them "
                   "(read by match, verify, audit and export) is written there.")
@click.option("--json", "as_json", is_flag=True)
@PLATFORM_OPTION
def plan(spec: str, engine: str, engine_root: str | None, pp: int, dump_dir: str | None, as_json: bool,
         platform: str | None) -> Any:
    """Every route that captures the spec's states on this release, least intrusive first: the serving
    config alone, the engine's native capture path, surgeon's patch as a plugin, the patch on disk.

    Each is judged for the draft (serve) and for the dumps (dump) from the release's source, with the
    launch to paste and the hazards, and the first that works is recommended. Example:
    surgeon plan specs/llama-3.1-8b-eagle3.yaml --engine vllm --dump-dir /data/hs

    Exit 0, 3 when every route refuses a need, 4 when the rest is undecided, 2 on bad input.
    """
    report = commands.plan(spec=spec, engine=engine, engine_root=engine_root, platform=platform, pp=pp,
                           dump_dir=dump_dir, progress=RichProgress(as_json))
    return _show(report, as_json, show.print_plan)


@main.command("upgrade-check")
@click.argument("specs", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--engine", type=ENGINE_CHOICE,
              help="The engine (default: the one both roots' dist-info names; needed with a version).")
@click.option("--from", "from_release", required=True, metavar="ROOT_OR_VERSION",
              help="The release deployed now: an engine package directory (or the folder holding it), or a version "
                   "(from the fetched cache under $XDG_CACHE_HOME/surgeon/releases, else pip-downloaded there as sources).")
@click.option("--to", "to_release", required=True, metavar="ROOT_OR_VERSION", help="The release to upgrade to (as --from).")
@click.option("--json", "as_json", is_flag=True)
@PLATFORM_OPTION
def upgrade_check(specs: tuple[str, ...], engine: str | None, from_release: str, to_release: str, as_json: bool,
                  platform: str | None) -> Any:
    """Before an engine upgrade: every spec's ids on both releases, whether the draft config deployed
    now would be served differently, and each class whose id meaning, capture sites or runner reads
    changed, with file:line on both sides.

    Exit 0, 3 when a deployed draft config would capture other points, 4 when that is undecided
    (code not read), 2 on bad input.
    """
    report = commands.upgrade_check(specs=specs, engine=engine, from_release=from_release, to_release=to_release,
                                    platform=platform, progress=RichProgress(as_json))
    return _show(report, as_json, show.print_upgrade_check)


@main.command("sweep-spec")
@click.option("--name", required=True)
@click.option("--architecture", required=True)
@click.option("--num-layers", required=True, type=click.IntRange(1, 100000))
@click.option("--hidden-size", required=True, type=click.IntRange(1, 10**7))
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Write here instead of stdout (refuses to overwrite).")
def sweep_spec(name: str, architecture: str, num_layers: int, hidden_size: int, output: str | None) -> Any:
    """A spec capturing every point (embed, each layer_out, final_norm): an engine's dump of it is a
    reference where HF cannot run the model."""
    text = commands.sweep_spec(name=name, architecture=architecture, num_layers=num_layers,
                               hidden_size=hidden_size, output=output)
    return _show(text, False, show.print_generated)


# --------------------------------------------------------------------------------------------- the wiring harness
@main.command()
@click.argument("model")
@click.option("--input-ids", required=True, help="Token ids to run, comma- or space-separated.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Reference file to write (safetensors).")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]),
              help="Run the model in this dtype (the recorded states are stored as float32).")
@click.option("--device", default="cpu", show_default=True, help="Run the model on this torch device (cpu, cuda, cuda:1, ...).")
def reference(model: str, input_ids: str, output: str, dtype: str, device: str) -> Any:
    """Run an HF model (a folder, hf:DIR, or hf:ORG/NAME from the local Hugging Face cache, never
    downloaded) on INPUT_IDS and record every physical point (embed, each layer_out and
    layer_delta, final_norm) into a reference file."""
    r = commands.reference(model=model, input_ids=input_ids, output=output, dtype=dtype, device=device,
                           progress=RichProgress())
    show.out.print(f"wrote {escape(r.output)}: {r.points} points x {r.tokens} tokens, L={r.num_layers}, H={r.hidden_size}")
    return r


@main.command()
@click.argument("ref")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
@click.option("--input-ids", help="Token ids, for an hf:DIR reference.")
@click.option("--dim", default=64, show_default=True, help="Random projection width.")
@click.option("--seed", default=0, show_default=True)
def fingerprint(ref: str, output: str, input_ids: str | None, dim: int, seed: int) -> Any:
    """Write a small fingerprint of REF (hf:DIR or a reference file) that identification can use
    instead of the full tensors: keep it next to the spec."""
    fp = commands.fingerprint(ref=ref, output=output, input_ids=input_ids, dim=dim, seed=seed, progress=RichProgress())
    show.out.print(f"wrote {escape(fp.output)}: {fp.points} points x {fp.tokens} tokens, dim {fp.dim}, seed {fp.seed}")
    return fp


def _harness_options(f):
    f = click.option("--slots", multiple=True,
                     help="Which slots to read and what they are. A file that names its tensors (a dict, named "
                          "safetensors, a surgeon dump) is read by name: KEY, NAME=KEY or KEY=POINT. A stack, list "
                          "or SpecForge aux is named in its order: name, point or name=point. PRODUCER:IDS labels a "
                          "dump by the ids its writer was given (vllm, trtllm, modelopt-hf|vllm|trtllm; sglang:ALGO:IDS "
                          "through the SGLang class's EAGLE3 or DFLASH setter). A surgeon-capture.json beside the file "
                          "(written by `surgeon plan --dump-dir`) labels a hidden_states stack with no flag. "
                          "Comma-separated or repeated.")(f)
    f = click.option("--input-ids", help="Token ids of the subject, when the file carries none.")(f)
    f = click.option("--json", "as_json", is_flag=True)(f)
    f = click.option("--plot", type=click.Path(dir_okay=False), help="Write the slots x points heatmap to this PNG.")(f)
    return f


@main.command()
@click.argument("subject", type=click.Path(dir_okay=False))
@click.option("--reference", "ref", required=True,
              help="hf:DIR, hf:ORG/NAME (local Hugging Face cache), a reference file, or a fingerprint file.")
@click.option("--spec", type=click.Path(dir_okay=False),
              help="Spec declaring the slots: by name where the file names its tensors, else its dump slots in order.")
@_harness_options
def match(subject: str, ref: str, spec: str | None, slots: tuple[str, ...], input_ids: str | None, as_json: bool,
          plot: str | None) -> Any:
    """Which physical point each slot of SUBJECT really is, how sure, and what is wrong (exit 4 when
    the reference cannot tell a slot's points apart: undecided)."""
    result = commands.match(subject=subject, ref=ref, spec=spec, slots=slots, input_ids=input_ids, plot=plot,
                            progress=RichProgress(as_json))
    _show(result, as_json, show.print_match)
    if not as_json and plot:
        show.out.print(f"heatmap: {escape(plot)}")
    return result


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--subject", required=True, type=click.Path(dir_okay=False))
@click.option("--reference", "ref", required=True,
              help="hf:DIR, hf:ORG/NAME (local Hugging Face cache), a reference file, or a fingerprint file.")
@_harness_options
def verify(spec: str, subject: str, ref: str, slots: tuple[str, ...], input_ids: str | None, as_json: bool,
           plot: str | None) -> Any:
    """Exit 0 when every slot of SUBJECT is what SPEC declares, 3 when not, 4 when the reference
    cannot decide (a slot fits its declared point and another about equally), 2 on bad input."""
    v = commands.verify(spec=spec, subject=subject, ref=ref, slots=slots, input_ids=input_ids, plot=plot,
                        progress=RichProgress(as_json))
    _show(v, as_json, lambda v: show.print_match(v.result))
    if not as_json:
        show.out.print("[green]wiring verified[/]" if v.ok else "[yellow]wiring not judged: undecided[/]"
                       if v.result.verdict == "undecided" else "[red]wiring differs from the spec[/]")
    return v


class _ExactBudget(click.ParamType):
    """``auto`` (None) or a count of files, 0 or more."""

    name = "N|auto"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | None:
        if value is None or isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        text = str(value).strip().lower()
        if text == "auto":
            return None
        if text.isdigit():
            return int(text)
        self.fail(f"{value!r} is neither auto nor a count of files (0 or more)", param, ctx)


_EXACT_BUDGET = _ExactBudget()


@main.command()
@click.argument("root", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--spec", required=True, type=click.Path(dir_okay=False), help="The spec the set was captured with.")
@click.option("--reference", "ref", help="hf:MODEL (a profile from the set's own first files, and exact identification "
                                         "of a sample), a reference file, a sweep dump or a fingerprint.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--report", type=click.Path(dir_okay=False),
              help="Write an HTML report with plots here (refuses to overwrite a file, never follows a link).")
@click.option("--workers", type=int,
              help="Local worker processes, at most one per usable core [default: one per usable core; 1 with "
                   "--structure-only].")
@click.option("--ray", "ray_address", help="Run on the Ray cluster at this address (needs the [ray] extra).")
@click.option("--resume", is_flag=True, help="Skip the files a previous run recorded as done (same size and mtime).")
@click.option("--structure-only", is_flag=True, help="Headers only: no values, no identity.")
@click.option("--state", type=click.Path(dir_okay=False),
              help="The resume state file (default: DIR/.surgeon-audit-state.jsonl).")
@click.option("--exact", type=_EXACT_BUDGET, default="auto", show_default=True,
              help="Exact identification (with --reference hf:MODEL): the target run on each file's own tokens, as "
                   "verify does. N: at most N files, first those whose identity the statistics leave undecided "
                   "(evenly spaced over them), then evenly spaced others; 0: none. auto: every undecided file when "
                   f"the target is small (its parameter count x those files' tokens <= {EXACT_PARAM_TOKENS:.0e}), "
                   f"else as many evenly spaced ones as fit that product, and {EXACT_SPOT} evenly spaced others as a "
                   "spot check.")
def audit(root: str, spec: str, ref: str | None, as_json: bool, report: str | None, workers: int | None,
          ray_address: str | None, resume: bool, structure_only: bool, state: str | None, exact: int | None) -> Any:
    """Check every file of the training set under DIR: structure, values, and the identity of each
    slot. Exit 0 when clean, 3 when any slot is not what SPEC declares or holds bad values, 4 when
    nothing was found but the identity of most files of a slot is undecided (the run cannot see
    shifted or off-by-one labels), 2 on bad input."""
    result = commands.audit(root=root, spec=spec, ref=ref, workers=workers, ray=ray_address, resume=resume,
                            report=report, structure_only=structure_only, exact=exact, state=state,
                            progress=RichProgress(as_json))
    return _show(result, as_json, show.print_audit)


# --------------------------------------------------------------------------------------------- capture code and dumps
_FIELD_SLOTS = ("PRODUCER:IDS for a dump that does not record its layers: trtllm, modelopt-hf, modelopt-vllm or "
                "modelopt-trtllm for a TensorRT-LLM or Model Optimizer .pt dump, vllm for a hidden_states stack "
                "(vLLM's hidden-state connector, speculators), and the ids it was given (e.g. modelopt-vllm:1,3,5); "
                "sglang:ALGO:IDS (EAGLE3 or DFLASH) for states SGLang's --enable-return-aux-hidden-states returned. "
                "A surgeon-capture.json beside a stack (`surgeon plan --dump-dir`) labels it with no flag.")


@main.command("dump-info")
@click.argument("dump", type=click.Path(dir_okay=False))
@click.option("--slots", help=_FIELD_SLOTS)
@click.option("--spec", type=click.Path(dir_okay=False), help="The target's spec: its layer count, for --slots.")
@click.option("--json", "as_json", is_flag=True)
def dump_info(dump: str, slots: str | None, spec: str | None, as_json: bool) -> Any:
    """What a dump says it is: spec, engine, model, and each capture's physical point. Also reads
    TensorRT-LLM and Model Optimizer dumps: their layout, records, and each slot's point as --slots says."""
    return _show(commands.dump_info(dump=dump, slots=(slots,) if slots else (), spec=spec), as_json,
                 show.print_dump_info)


@main.command()
@click.argument("dumps", nargs=-1, required=True, type=click.Path())
@click.option("--spec", "spec_path", required=True, type=click.Path(dir_okay=False), help="The spec the dumps were taken with.")
@click.option("--layout", required=True, type=click.Choice(["specforge", "speculators"]))
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Folder to write the exported files into.")
@click.option("--slots", help=_FIELD_SLOTS)
@click.option("--json", "as_json", is_flag=True)
def export(dumps: tuple[str, ...], spec_path: str, layout: str, out_dir: str, slots: str | None, as_json: bool) -> Any:
    """Export dumps (surgeon dumps, shard folders, TensorRT-LLM or Model Optimizer .pt dumps with
    --slots) to a training tool's layout, keeping its own semantics (SpecForge's hidden_state is
    final_norm; speculators' last slot is layer_out[L-1], pre-norm), or refuse when the dumps cannot
    fill it truthfully. Each written slot's point is recorded in surgeon-export.json."""
    exported = commands.export(dumps=dumps, spec=spec_path, layout=layout, out_dir=out_dir,
                               slots=(slots,) if slots else ())
    return _show(exported, as_json,
                 lambda e: show.out.print(f"wrote {len(e.written)} {e.layout} file(s) to {escape(e.out_dir)}; "
                                          f"each slot's point in {escape(str(e.manifest))}"))


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--mode", required=True, type=click.Choice(["aux", "dump"]),
              help="aux: hand the fc captures to the draft; dump: keep them for drain().")
@click.option("--max-tokens", required=True, type=click.IntRange(1, 1 << 24),
              help="The engine's maximum tokens per step (buffer rows).")
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Write the module here (refuses to overwrite); default stdout.")
def hooks(spec: str, mode: Any, max_tokens: int, output: str | None) -> Any:
    """Generate the CUDA-graph-safe capture hooks module for SPEC (checked before it is written)."""
    return _show(commands.hooks(spec=spec, mode=mode, max_tokens=max_tokens, output=output), False, show.print_generated)


@main.command("check-hooks")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
def check_hooks(files: tuple[str, ...], as_json: bool) -> Any:
    """Static graph-safety check of hook code: host syncs (.item, .cpu, .tolist), printing,
    torch.save and other I/O, per-step allocation, branches on tensor values. Exit 3 on findings."""
    return _show(commands.check_hooks(files=files), as_json, show.print_hook_check)


# --------------------------------------------------------------------------------------------- patches
@main.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--engine", required=True, type=ENGINE_CHOICE)
@click.option("--engine-root", type=click.Path(),
              help="Engine package directory (default: the installed package, found without importing it).")
@click.option("--mode", default="dump", show_default=True, type=click.Choice(["dump", "aux"]),
              help="dump: keep the captures for a drain after each step; aux: also hand the spec's fc input, in fc order, to "
                   "the engine's draft path where the forward returns aux_hidden_states.")
@click.option("--max-tokens", default=DEFAULT_MAX_TOKENS, show_default=True, type=click.IntRange(1, 1 << 24),
              help="The engine's maximum tokens per forward step (capture buffer rows).")
@click.option("--model-file",
              help="Model file to patch, relative to the engine root (default: where the probe finds the model class's decoder "
                   "loop, else the spec's pinned model_file).")
@click.option("--loop-class",
              help="The class whose forward holds the decoder-layer loop (default: the probe's, else the file's only one).")
@click.option("--name", help="Patch name (default: the spec's name).")
@click.option("--dry-run", is_flag=True, help="Show what would change; write nothing.")
@click.option("--diff", "show_diff", is_flag=True, help="Print the unified diff of the change.")
@click.option("--replace", is_flag=True, help="Revert a patch already on these files first (in the same transaction).")
@click.option("--guard-bypass", is_flag=True,
              help="Where decoder layers can run outside the capture loop (SGLang two-batch overlap), insert a runtime guard "
                   "that raises if a captured layer would run there, instead of refusing.")
@click.option("--deliver", default="disk", show_default=True, type=click.Choice(["disk", "plugin"]),
              help="disk: write the engine's model file; plugin: build an installable vllm.general_plugins package in -o "
                   "DIR carrying the rewritten module (the engine is only read; uninstalling it is the revert).")
@click.option("-o", "--out", type=click.Path(file_okay=False), help="The plugin's folder (with --deliver plugin).")
@click.option("--json", "as_json", is_flag=True)
@PLATFORM_OPTION
def apply(spec: str, engine: str, engine_root: str | None, mode: Any, max_tokens: int, model_file: str | None,
          loop_class: str | None, name: str | None, dry_run: bool, show_diff: bool, replace: bool,
          guard_bypass: bool, deliver: Any, out: str | None, as_json: bool, platform: str | None) -> Any:
    """Put SPEC's captures into the engine's real model file, with a generated hooks module next to it,
    or (--deliver plugin -o DIR) into a plugin package that installs them at engine start.

    One journaled transaction: each file ends either original or fully patched; `surgeon revert`
    gives back the exact original bytes. A plugin checks the engine file's sha256 and the release at
    every engine start and stops the start on drift. Example:
    surgeon apply specs/llama-3.1-8b-eagle3.yaml --engine vllm --deliver plugin -o ./llama-plugin
    """
    outcome = commands.apply(spec=spec, engine=engine, engine_root=engine_root, mode=mode, max_tokens=max_tokens,
                             model_file=model_file, loop_class=loop_class, name=name, dry_run=dry_run,
                             diff=show_diff, replace=replace, guard_bypass=guard_bypass, deliver=deliver, out=out,
                             platform=platform, progress=RichProgress(as_json))
    return _show(outcome, as_json, show.print_apply)


@main.command()
@click.argument("name", required=False)
@click.option("--all", "all_", is_flag=True, help="Revert every patch.")
@click.option("--force", is_flag=True, help="Drop files changed since apply (drift) from the manifest, leaving them alone.")
@click.option("--engine", type=ENGINE_CHOICE, help="Default: every installed engine holding patches.")
@click.option("--engine-root", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def revert(name: str | None, all_: bool, force: bool, engine: str | None, engine_root: str | None, as_json: bool) -> Any:
    """Restore the byte-identical originals of patch NAME (or the only patch, or --all)."""
    report = commands.revert(name=name, all_=all_, force=force, engine=engine, engine_root=engine_root)
    return _show(report, as_json, show.print_revert)


@main.command()
@click.option("--engine", type=ENGINE_CHOICE, help="Default: every installed engine.")
@click.option("--engine-root", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def status(engine: str | None, engine_root: str | None, as_json: bool) -> Any:
    """What surgeon has patched in each engine, and whether every file is still as patched.

    Exit 3 when a patched file drifted (an engine upgrade, a hand edit) or went missing."""
    return _show(commands.status(engine=engine, engine_root=engine_root), as_json, show.print_status)


@main.command()
@click.argument("name", required=False)
@click.option("--engine", type=ENGINE_CHOICE, help="Default: every installed engine.")
@click.option("--engine-root", type=click.Path())
@click.option("--json", "as_json", is_flag=True)
def diff(name: str | None, engine: str | None, engine_root: str | None, as_json: bool) -> Any:
    """The unified diff (original -> patched) of patch NAME, or of every patch, from the stored
    originals and patched bytes (exit 2 when there is no such patch)."""
    report = commands.diff(name=name, engine=engine, engine_root=engine_root)
    return _show(report, as_json, lambda r: click.echo(r.text, nl=False))


@main.command()
@click.option("--engine", type=ENGINE_CHOICE, help="Default: every installed engine.")
@click.option("--engine-root", type=click.Path())
@click.option("--repair", is_flag=True, help="Rebuild what can be proven from stored copies and markers.")
@click.option("--json", "as_json", is_flag=True)
def doctor(engine: str | None, engine_root: str | None, repair: bool, as_json: bool) -> Any:
    """Check the patch state (links, owners, damaged or lost state files, patched files no manifest
    records) and say what can be rebuilt; --repair rebuilds it. Never guesses. Exit 3 while
    anything is left unfixed."""
    report = commands.doctor(engine=engine, engine_root=engine_root, repair=repair)
    return _show(report, as_json, show.print_doctor)


@main.command()
@click.option("--engine", required=True, type=ENGINE_CHOICE)
@click.option("--engine-root", type=click.Path())
@click.option("--jobs", type=click.IntRange(1, 64), help="Worker processes (default: 2).")
@click.option("--all", "show_all", is_flag=True, help="List every loop-owning class, not only the ones that cannot be patched.")
@click.option("--json", "as_json", is_flag=True)
@PLATFORM_OPTION
def coverage(engine: str, engine_root: str | None, jobs: int | None, show_all: bool, as_json: bool, platform: str | None) -> Any:
    """For every model file and class with a decoder-layer loop: can surgeon patch it, does the engine
    capture natively, and why not when it cannot."""
    report = commands.coverage(engine=engine, engine_root=engine_root, jobs=jobs, platform=platform,
                               progress=RichProgress(as_json))
    return _show(report, as_json, lambda r: show.print_coverage(r, show_all))


# --------------------------------------------------------------------------------------------- demo
@main.command()
@click.option("--workdir", type=click.Path(file_okay=False),
              help="New folder for everything the demo writes (default: ./surgeon-demo-<time>).")
@click.option("--engine-root", type=click.Path(), help="The vLLM package directory to patch (default: the installed one).")
@click.option("--json", "as_json", is_flag=True)
def demo(workdir: str | None, engine_root: str | None, as_json: bool) -> Any:
    """The whole loop on the real vLLM engine with a tiny model made here: apply the demo spec,
    run, verify the dump, catch a mis-wired variant (heatmap PNG), revert byte-identically."""
    import time

    started = time.perf_counter()
    with show.demo_display(as_json, started) as (step, note):
        report = commands.demo(workdir=workdir, engine_root=engine_root, step=step, note=note)
    return _show(report, as_json, lambda r: show.print_demo(r, started))
