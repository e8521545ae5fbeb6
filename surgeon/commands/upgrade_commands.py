"""`surgeon upgrade-check`: each ROOT_OR_VERSION resolved to an engine release on disk (a folder,
or a version from the fetched cache, downloaded as sources when it is not there: never installed),
both probed with progress, then the library's comparison (:mod:`surgeon.wiring.upgrade`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from surgeon.commands.platform import engine_command
from surgeon.commands.progress import QUIET, Progress
from surgeon.core.errors import BadInput


@engine_command
def upgrade_check(*, specs: Sequence[str], from_release: str, to_release: str, engine: str | None = None,
                  platform: str | None = None, progress: Progress = QUIET) -> Any:
    """Every spec's ids on both releases and the verdict on its deployed draft config (exit 3 where
    the new release serves it differently, 4 where that is undecided), and each class whose id
    meaning, capture sites or runner reads changed, with file:line on both sides."""
    from surgeon.core.spec import load_spec
    from surgeon.engines.view import open_engine
    from surgeon.wiring.upgrade import upgrade_check as check

    loaded = [load_spec(s) for s in specs]
    engine = engine or engine_of(from_release, to_release)
    roots = [release_root(engine, arg, progress) for arg in (from_release, to_release)]
    for arg, root in zip((from_release, to_release), roots):
        with progress.bar(f"probing {engine} {arg}") as update:
            open_engine(engine, root, progress=update)
    return check(loaded, engine, roots[0], roots[1], platform)


def engine_of(*args: str) -> str:
    """The engine both ROOT_OR_VERSIONs name: the one engine whose package is there with a dist-info
    beside it naming its distribution (bad input where a root names none or both, or they differ)."""
    from surgeon.engines.source.locate import LAYOUTS, ProbeError, locate_engine

    def named(arg: str) -> set[str]:
        path = Path(arg).expanduser()
        found = set()
        for engine in LAYOUTS if path.is_dir() else ():
            try:
                found.update([engine] if locate_engine(engine, path).distribution else [])
            except ProbeError:
                continue
        return found

    engines = [named(a) for a in args]
    if any(len(e) != 1 for e in engines) or len(set().union(*engines)) != 1:
        raise BadInput("--engine is needed: --from and --to must both be engine roots whose dist-info names the same "
                       "engine (sglang or vllm) to leave it out")
    return engines[0].pop()


def release_root(engine: str, arg: str, progress: Progress = QUIET) -> str:
    """The package directory ROOT_OR_VERSION ``arg`` names: an existing folder as given, else the
    release of that version from the fetched cache, downloaded into it (pip download --no-deps,
    sources only) when it is not there."""
    from surgeon.engines.source import releases
    from surgeon.engines.source.locate import LAYOUTS, ProbeError, locate_engine

    path = Path(arg).expanduser()
    if path.is_dir():
        try:
            return str(locate_engine(engine, path).root)
        except ProbeError as e:
            raise BadInput(f"{arg}: {e}") from None
    if path.exists() or not releases.is_version(arg):
        raise BadInput(f"{arg}: neither an engine root (a directory) nor a release version of {engine}")
    dist, package = LAYOUTS[engine].distributions[0], LAYOUTS[engine].package
    folder = releases.cached(dist, arg, releases.cache_dir())
    if folder is None:
        with progress.spinner(f"downloading {dist} {arg} as sources (pip download --no-deps)"):
            try:
                folder, _ = releases.fetch(dist, arg, releases.cache_dir(), quiet_pip=True)
            except releases.ReleaseError as e:
                raise BadInput(f"{dist} {arg}: {e}") from None
            except OSError as e:
                raise BadInput(f"{dist} {arg}: cannot unpack into {releases.cache_dir()}: {e.strerror or e}") from None
    return str(folder / package)
