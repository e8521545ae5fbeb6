"""The demo command: the whole loop on the real vLLM engine with a tiny model made here."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


@dataclass
class DemoReport:
    """The demo's run; it passes when the right wiring verifies, the wrong one is caught and the
    engine file comes back byte-identical. ``problem`` says what went wrong otherwise."""

    result: Any  # surgeon.run.demo.DemoResult

    @property
    def problem(self) -> str | None:
        r = self.result
        if not r.reverted_identical:
            return f"internal error: {r.engine_root / r.model_file} is not byte-identical after the run ({r.route})"
        if not r.right.ok:
            return "the demo's wiring check did not come out as expected (see above): the spec's wiring failed verify"
        if r.wrong.ok:
            return "the demo's wiring check did not come out as expected (see above): the mis-wiring was not caught"
        if r.draft is not None and not r.draft.ok:
            return ("the demo's draft step did not come out as expected (see above): the trained wiring was not "
                    "named with a decided margin, or the mis-labelled deployment did not accept less")
        return None

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def exit_code(self) -> int:
        if self.ok:
            return 0
        return 1 if not self.result.reverted_identical else 3

    @property
    def reported(self) -> Any:
        """The demo's run: what ``--json`` prints (surgeon.commands.outputs.drafts.DemoOutput)."""
        return self.result
