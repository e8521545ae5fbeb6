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


def is_safetensors(path: str | Path) -> bool:
    """Whether ``path`` has the safetensors structure: an 8-byte little-endian header length N, then
    N bytes of JSON (``{`` first) inside the file.

    Sniff this before pickle magic: the first byte of a safetensors file is the low byte of its
    header length, so a header of 0x380 bytes starts with ``80 03``, which is also how a protocol-3
    pickle starts. Checking for pickle first read such a dump as a plain file whose slots come in
    key order (alphabetical), silently, for one header length in 256."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = f.seek(0, 2)
    except OSError:
        return False
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= size - 8 and head[8:9] == b"{"


def safetensors_kind(path: str | Path) -> str | None:
    """The ``surgeon.kind`` a safetensors file declares (reference, fingerprint, dump), or None for
    anything else, including files that are not safetensors at all."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("surgeon.kind")
    except Exception:
        return None
