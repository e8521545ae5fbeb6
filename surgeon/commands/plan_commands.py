"""`surgeon plan`: every capture route for a spec on one engine release (:mod:`surgeon.patch.routes`),
and with ``--dump-dir`` the sidecar that labels the files the recommended native route writes there
(:mod:`surgeon.capture.sidecar`)."""

from __future__ import annotations

from pathlib import Path

from surgeon.commands.platform import engine_command
from surgeon.commands.progress import QUIET, Progress


@engine_command
def plan(*, spec: str, engine: str, engine_root: str | None = None, platform: str | None = None, pp: int = 1,
         dump_dir: str | None = None, progress: Progress = QUIET):
    """Each route (serving config, native capture path, plugin, on-disk patch) judged for the spec's
    draft and its dumps; the first that works per need is the recommendation (exit 3 where every
    route refuses a need, 4 where what is left is undecided)."""
    from surgeon.core.spec import load_spec
    from surgeon.engines.view import open_engine
    from surgeon.patch.routes import plan as make_plan

    loaded = load_spec(spec)
    if engine in ("vllm", "sglang"):
        with progress.bar(f"probing {engine}") as update:
            open_engine(engine, engine_root, progress=update)
    report = make_plan(loaded, engine, engine_root=engine_root, platform=platform, pp=pp, dump_dir=dump_dir)
    if dump_dir is not None:
        report.sidecar = _write_sidecar(report, loaded, Path(dump_dir))
    return report


def _write_sidecar(report, spec, dump_dir: Path) -> str | None:
    """The sidecar of the native route's files, where that route works for the dump and writes a
    stack that records nothing itself (vLLM's connector); None (and a note) otherwise."""
    from surgeon.capture.sidecar import CaptureSidecar, write_sidecar

    native = report.route("native")
    verdict = native.verdicts.get("dump")
    if report.recommended.get("dump") != "native" or verdict is None or report.engine != "vllm":
        report.notes.append(f"--dump-dir {dump_dir}: no sidecar written (the dump's route is "
                            f"{report.recommended.get('dump') or 'none'}; only vLLM's native connector files need one)")
        return None
    assert verdict.ids is not None and report.release is not None and report.model_class is not None
    sidecar = CaptureSidecar(spec=spec.name, engine=report.engine, release=report.release, route="native",
                             method=native.config["speculative_config"]["method"], model_class=report.model_class,
                             num_layers=spec.num_layers, ids=tuple(verdict.ids), points=tuple(verdict.captures),
                             names=tuple(verdict.names))
    return str(write_sidecar(dump_dir, sidecar))
