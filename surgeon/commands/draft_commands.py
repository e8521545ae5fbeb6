"""Commands on draft checkpoints as evidence of their wiring: accept."""

from __future__ import annotations

from typing import Any

from surgeon.commands.platform import engine_command
from surgeon.commands.progress import QUIET, Progress


@engine_command
def accept(*, spec: str, draft: str, target: str, prompts: str | None = None, steps: int = 3,
           min_rate: float | None = None, length: int | None = None, progress: Progress = QUIET) -> Any:
    """Teacher-forced greedy acceptance of ``draft`` on ``target`` for the spec's wiring and the
    wirings bugs produce (an AcceptReport; exit 3 when the spec's position-1 acceptance is below
    ``min_rate``)."""
    from surgeon.core.optional import require

    require("torch")
    require("transformers")
    from surgeon.core.spec import load_spec
    from surgeon.draft.accept import DEFAULT_LENGTH, run_accept

    s = load_spec(spec)
    with progress.spinner("capturing the target's states once per prompt and running the draft per wiring"):
        return run_accept(s, draft, target, prompts_file=prompts, steps=steps, min_rate=min_rate,
                          length=DEFAULT_LENGTH if length is None else length)
