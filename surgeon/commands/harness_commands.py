"""Commands of the wiring harness: reference, fingerprint, match, verify."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from surgeon.commands.platform import engine_command
from surgeon.commands.progress import QUIET, Progress
from surgeon.core.errors import BadInput
from surgeon.core.safefile import check_writable
from surgeon.core.shapes import Reads

DTYPES = ("float32", "bfloat16", "float16")


def reference(*, model: str, input_ids: str, output: str, dtype: str = "float32", device: str = "cpu",
              progress: Progress = QUIET) -> ReferenceWritten:
    """Run the HF model ``model`` (a folder, ``hf:DIR`` or ``hf:ORG/NAME`` from the local Hugging Face
    cache) on ``input_ids`` in ``dtype`` on ``device``, and write every physical point to ``output``."""
    import torch

    from surgeon.verify.harness import parse_input_ids
    from surgeon.verify.reference import capture_reference, save_reference

    if dtype not in DTYPES:
        raise BadInput(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    check_writable(output, what="the reference output")  # refused before the model runs, not after
    model = model[3:] if model.startswith("hf:") else model
    with progress.bar("running the HF reference"):
        ref = capture_reference(model, parse_input_ids(input_ids), dtype=getattr(torch, dtype), device=device)
    save_reference(ref, output)
    return ReferenceWritten(output, len(ref.states), ref.input_ids.numel(), ref.num_layers, ref.hidden_size)


def fingerprint(*, ref: str, output: str, input_ids: str | None = None, dim: int = 64,
                seed: int = 0, progress: Progress = QUIET) -> FingerprintWritten:
    """Write a small fingerprint of ``ref`` (hf:DIR or a reference file) to ``output``."""
    from surgeon.verify.fingerprint import Fingerprint, fingerprint_file, save_fingerprint
    from surgeon.verify.fingerprint import fingerprint as make_fingerprint
    from surgeon.verify.harness import load_reference_arg, parse_input_ids

    if dim < 8 or dim > 4096:
        raise BadInput("--dim must be between 8 and 4096")
    check_writable(output, what="the fingerprint output")
    with progress.spinner("fingerprinting the reference"):
        if not ref.startswith("hf:") and Path(ref).is_file():
            fp = fingerprint_file(ref, dim=dim, seed=seed)
        else:
            loaded = load_reference_arg(ref, parse_input_ids(input_ids))
            fp = loaded if isinstance(loaded, Fingerprint) else make_fingerprint(loaded, dim=dim, seed=seed)
    save_fingerprint(fp, output)
    return FingerprintWritten(output, len(fp.proj), fp.input_ids.numel(), fp.dim, fp.seed)


@engine_command
def match(*, subject: str, ref: str, spec: str | None = None, slots: Sequence[str] = (),
          input_ids: str | None = None, plot: str | None = None, progress: Progress = QUIET) -> Any:
    """Which physical point each slot of ``subject`` really is (a HarnessResult); ``plot`` also
    writes the slots x points heatmap there."""
    from surgeon.core.optional import require
    from surgeon.core.spec import load_spec

    if plot:
        require("matplotlib")  # before the work, not after it
    from surgeon.verify.harness import match as match_subject
    from surgeon.verify.harness import plot_heatmap

    loaded = load_spec(spec) if spec else None
    with progress.spinner("identifying each slot against the reference"):
        result = match_subject(subject, ref, spec=loaded, slots=slots, input_ids=input_ids)
    if plot:
        with progress.spinner("drawing the heatmap"):
            plot_heatmap(result, plot)
    return result


@engine_command
def verify(*, spec: str, subject: str, ref: str, slots: Sequence[str] = (), input_ids: str | None = None,
           plot: str | None = None, progress: Progress = QUIET) -> Verification:
    """Is every slot of ``subject`` what ``spec`` declares? Not: a mismatch (exit 3)."""
    return Verification(match(subject=subject, ref=ref, spec=spec, slots=slots, input_ids=input_ids, plot=plot,
                              progress=progress))


@dataclass
class ReferenceWritten:
    output: str
    points: int
    tokens: int
    num_layers: int
    hidden_size: int


@dataclass
class FingerprintWritten:
    output: str
    points: int
    tokens: int
    dim: int
    seed: int


@dataclass
class Verification:
    """A subject checked against its spec: any slot that is not what the spec declares is a mismatch."""

    result: Any  # surgeon.verify.harness.HarnessResult

    ok = Reads("result.ok")
    # 0 every declared slot as declared, 3 one is not, 4 undecided (none wrong, one the reference
    # cannot tell apart)
    exit_code = Reads("result.exit_code")
    reported = Reads("result")  # what --json prints (surgeon.commands.outputs.harness.VerifyOutput)
