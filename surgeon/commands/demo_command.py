"""The demo command: the whole loop on the real vLLM engine with a tiny model made here."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from surgeon.commands.results import DemoReport


def default_workdir() -> Path:
    """A new, time-stamped folder under the current directory, so a demo never reuses one."""
    return Path.cwd() / time.strftime("surgeon-demo-%Y%m%d-%H%M%S")


def demo(*, workdir: str | None = None, engine_root: str | None = None,
         step: Callable[[str], None] = lambda title: None,
         note: Callable[[str], None] = lambda text: None) -> DemoReport:
    """Apply the demo spec, run vLLM, verify the dump, catch a mis-wired variant, revert.
    ``step`` hears each step's title as it starts, ``note`` one-line details."""
    from surgeon.run.demo import run_demo

    work = Path(workdir) if workdir else default_workdir()
    return DemoReport(run_demo(work, step=step, note=note, engine_root=engine_root))
