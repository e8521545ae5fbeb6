"""Commands that read a draft checkpoint as evidence of its wiring: infer-wiring."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from surgeon.commands.platform import engine_command
from surgeon.commands.progress import QUIET, Progress
from surgeon.commands.results import write_new_file
from surgeon.core.errors import BadInput

MAX_PROMPTS_BYTES = 4 << 20


def read_prompts(path: str) -> list[Any]:
    """Token-id prompts, one per non-empty line (integers separated by commas or spaces)."""
    import torch

    from surgeon.core.spec import read_regular_file

    try:
        text = read_regular_file(Path(path), MAX_PROMPTS_BYTES).decode("utf-8")
    except (OSError, ValueError) as e:
        raise BadInput(f"--prompts {path}: {getattr(e, 'strerror', None) or e}") from None
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids = [int(x) for x in line.replace(",", " ").split()]
        except ValueError:
            raise BadInput(f"{path}:{n}:1: expected token ids (integers separated by commas or spaces)") from None
        prompts.append(torch.tensor(ids, dtype=torch.int64))
    if not prompts:
        raise BadInput(f"{path}: no prompts (one line of token ids per prompt)")
    return prompts


@engine_command
def infer_wiring(*, draft: str, target: str, prompts: str | None = None, output: str | None = None,
                 progress: Progress = QUIET) -> Any:
    """The wiring ``draft``'s fc was trained on, against the HF model ``target``, with margins, each
    engine's ids, a check of the ids the draft config states (exit 3 when they disagree or are
    missing) and, with ``output``, a spec v1 written there for review (an InferReport)."""
    from surgeon.draft.infer import infer_wiring as infer

    if output is not None and os.path.lexists(output):
        raise BadInput(f"{output} exists; not overwritten")
    loaded = read_prompts(prompts) if prompts else None
    with progress.spinner("reading the draft's fc against every point of the target"):
        report = infer(draft, target, prompts=loaded)
    if output is not None:
        report.written = write_new_file(report.spec, output).written
    return report
