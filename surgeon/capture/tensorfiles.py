"""Reading safetensors files as bad-input-safe one-liners: the one place that turns a broken or
foreign file into a located BadInput, shared by every reader (references, fingerprints, dumps,
subjects, draft checkpoints)."""

from __future__ import annotations

from pathlib import Path

import torch

from surgeon.core.errors import BadInput


def unreadable(path: str | Path, error: BaseException) -> BadInput:
    """The one-line BadInput for a file safetensors cannot read (its errors span several lines)."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return BadInput(f"{path}: not a readable safetensors file ({first})")


def read_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor and the string metadata of a safetensors file."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{p}: no such file")
    try:
        with safe_open(str(p), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as e:  # SafetensorError and friends
        raise unreadable(p, e) from None


def safetensors_kind(path: str | Path) -> str | None:
    """The ``surgeon.kind`` a safetensors file declares (reference, fingerprint, dump), or None for
    anything else, including files that are not safetensors at all."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("surgeon.kind")
    except Exception:
        return None
