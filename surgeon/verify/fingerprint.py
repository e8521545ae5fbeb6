"""Fingerprints: a small file per reference from which identification works without the full
hidden states (a repository keeps golden fingerprints next to its specs).

For every point of a reference and every token, a fingerprint keeps

* ``proj``: the token's state times a seeded random projection ``[H, dim]`` (Rademacher signs
  scaled by ``1/sqrt(dim)``, so ``E||xP||^2 = ||x||^2``: distances are preserved in expectation,
  with a relative spread of about ``sqrt(2 / (dim * tokens))`` on a Frobenius norm);
* ``norms``: the token's exact L2 norm (the exact denominator of a relative error, and the scale
  a no-match diagnosis compares);
* ``first``: its first ``first_k`` values, the numbers a human compares by eye (the debugging
  story this tool automates was solved by reading first-five values and per-token norms).

The projection is built from integers drawn from a seeded ``torch.Generator`` (signs only, no
floating-point transcendental functions), so the same ``(hidden_size, dim, seed)`` gives a
bit-identical matrix on every platform; the tests pin a checksum of it.

``dim`` is capped at ``max(8, hidden_size // 8)`` (and at ``hidden_size``): a projection wider than
an eighth of the hidden size buys little accuracy and makes the "small" file as large as the
reference itself on a tiny model (H=64, dim=64 would be 110% of the reference; the cap makes it
about 22%). A Kimi-sized model (H=7168) keeps dim 64: 124 points x 2048 tokens is ~70 MB
instead of 7.3 GB.

File format (safetensors): tensors ``input_ids`` [T] int64, ``proj`` [C, T, dim], ``norms`` [C, T],
``first`` [C, T, first_k] (all float32, C points in forward order), and string metadata
``surgeon.kind = fingerprint``, ``surgeon.fingerprint_version``, ``points`` (JSON list),
``seed``, ``dim``, ``first_k``, ``num_layers``, ``hidden_size``, ``source``, ``projection``.

:func:`fingerprint_file` streams a reference file written by ``surgeon.verify.reference.save_reference``:
it reads each tensor in token chunks through ``safe_open(...).get_slice(name)[a:b]`` (memory
mapped) and reopens the file every ``window_bytes`` so that neither the process's private memory
nor its mapped file pages grow with T (only the fingerprint itself does, at dim/H of the input).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from surgeon.capture.tensorfiles import SAFETENSORS, open_tensor_file, read_safetensors, unreadable
from surgeon.core.errors import BadInput
from surgeon.core.points import Point, PointError, all_points, parse_point
from surgeon.core.safefile import write_file
from surgeon.verify.streams import run_streams

KIND = "fingerprint"
VERSION = "1"
PROJECTION = "rademacher-v1"
_CHUNK_BYTES = 8 << 20  # rows per chunk in memory: ~8 MB of float32 (292 tokens at H=7168)
_STREAM_CHUNK_BYTES = 16 << 20  # rows per read from a file (585 tokens at H=7168)
_WINDOW_BYTES = 64 << 20  # per reader: reopen the mapping after touching this much


@dataclass
class Fingerprint:
    seed: int
    dim: int
    first_k: int
    input_ids: torch.Tensor  # [T] int64
    num_layers: int
    hidden_size: int
    source: str
    proj: dict[Point, torch.Tensor]  # [T, dim] float32
    norms: dict[Point, torch.Tensor]  # [T] float32
    first: dict[Point, torch.Tensor]  # [T, first_k] float32

    @property
    def points(self) -> list[Point]:
        return sorted(self.proj, key=lambda p: p.depth(self.num_layers))


def effective_dim(hidden_size: int, dim: int) -> int:
    """The projection width actually used for ``dim`` requested (see the module docstring)."""
    return max(1, min(int(dim), int(hidden_size), max(8, int(hidden_size) // 8)))


def projection_matrix(hidden_size: int, dim: int, seed: int) -> torch.Tensor:
    """``[hidden_size, dim]`` float32 random signs ``+-1/sqrt(dim)``: deterministic across runs
    and platforms (integer draws from ``torch.Generator().manual_seed(seed)``), norm-preserving in
    expectation. ``dim`` is used as given here; :func:`fingerprint` applies the cap."""
    if hidden_size < 1 or dim < 1:
        raise BadInput(f"projection sizes must be positive (hidden_size={hidden_size}, dim={dim})")
    g = torch.Generator().manual_seed(int(seed))
    bits = torch.randint(0, 2, (int(hidden_size), int(dim)), generator=g, dtype=torch.int64)
    return (bits.to(torch.float32) * 2.0 - 1.0) * (1.0 / math.sqrt(dim))


def _rows_per_chunk(hidden_size: int, chunk_tokens: int | None, chunk_bytes: int = _CHUNK_BYTES) -> int:
    if chunk_tokens is not None:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise BadInput(f"chunk_tokens must be a positive integer, not {chunk_tokens!r}")
        return chunk_tokens
    return max(1, chunk_bytes // (4 * hidden_size))


class _Builder:
    """Accumulates one fingerprint, chunk by chunk, into preallocated outputs."""

    def __init__(self, points: list[Point], T: int, H: int, dim: int, first_k: int, seed: int):
        self.points = points
        self.P = projection_matrix(H, dim, seed)
        self.first_k = first_k
        C = len(points)
        self.proj = torch.empty(C, T, dim, dtype=torch.float32)
        self.norms = torch.empty(C, T, dtype=torch.float32)
        self.first = torch.empty(C, T, first_k, dtype=torch.float32)

    def add(self, c: int, a: int, x: torch.Tensor) -> None:
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        b = a + x.shape[0]
        torch.mm(x, self.P, out=self.proj[c, a:b])
        torch.linalg.vector_norm(x, dim=1, out=self.norms[c, a:b])
        self.first[c, a:b] = x[:, : self.first_k]

    def build(self, *, seed, dim, first_k, input_ids, num_layers, hidden_size, source) -> Fingerprint:
        return Fingerprint(
            seed=int(seed), dim=int(dim), first_k=int(first_k), input_ids=input_ids,
            num_layers=int(num_layers), hidden_size=int(hidden_size), source=str(source),
            proj={p: self.proj[i] for i, p in enumerate(self.points)},
            norms={p: self.norms[i] for i, p in enumerate(self.points)},
            first={p: self.first[i] for i, p in enumerate(self.points)},
        )


def _check_sizes(dim: int, first_k: int, H: int) -> tuple[int, int]:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise BadInput(f"fingerprint dim must be a positive integer, not {dim!r}")
    if isinstance(first_k, bool) or not isinstance(first_k, int) or first_k < 0:
        raise BadInput(f"fingerprint first_k must be a non-negative integer, not {first_k!r}")
    return effective_dim(H, dim), min(first_k, H)


def fingerprint(ref, *, dim: int = 64, first_k: int = 5, seed: int = 0) -> Fingerprint:
    """The fingerprint of an in-memory ``surgeon.verify.reference.Reference``."""
    points = sorted(ref.states, key=lambda p: p.depth(ref.num_layers))
    T = int(ref.input_ids.numel())
    H = int(ref.hidden_size)
    dim, first_k = _check_sizes(dim, first_k, H)
    b = _Builder(points, T, H, dim, first_k, seed)
    rows = _rows_per_chunk(H, None)
    for c, p in enumerate(points):
        x = ref.states[p]
        if tuple(x.shape) != (T, H):
            raise BadInput(f"reference state {p} has shape {list(x.shape)}, expected {[T, H]}")
        for a in range(0, T, rows):
            b.add(c, a, x[a : a + rows])
    return b.build(seed=seed, dim=dim, first_k=first_k, input_ids=ref.input_ids.detach().to(torch.int64).clone(),
                   num_layers=ref.num_layers, hidden_size=H, source=ref.source)


def fingerprint_file(path: str | os.PathLike, *, dim: int = 64, first_k: int = 5, seed: int = 0,
                     chunk_tokens: int | None = None, window_bytes: int = _WINDOW_BYTES,
                     workers: int | None = None) -> Fingerprint:
    """The fingerprint of a reference file, streamed: each tensor is read ``chunk_tokens`` rows
    at a time (default: ~16 MB) through ``get_slice(name)[a:b]`` on a memory map that each reader
    reopens every ``window_bytes``, so working memory is bounded by ``workers`` x (chunk +
    window), not by T. ``workers`` (default: torch's thread count) readers run in parallel, each
    single-threaded; torch's thread count is restored afterwards."""
    path = open_tensor_file(Path(path), formats=(SAFETENSORS,)).path  # the gate, before any read
    head = _read_reference_header(path)
    T, H = int(head.input_ids.numel()), head.hidden_size
    dim, first_k = _check_sizes(dim, first_k, H)
    rows = _rows_per_chunk(H, chunk_tokens, _STREAM_CHUNK_BYTES)
    b = _Builder(head.points, T, H, dim, first_k, seed)
    _stream_reference(path, b, head.points, T, rows, window_bytes, workers)
    return b.build(seed=seed, dim=dim, first_k=first_k, input_ids=head.input_ids, num_layers=head.num_layers,
                   hidden_size=H, source=head.meta.get("source", str(path)))


@dataclass
class _ReferenceHeader:
    """What a reference file declares, checked before any state is read."""

    meta: dict
    num_layers: int
    hidden_size: int
    input_ids: torch.Tensor
    points: list[Point]


def _open_safetensors(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # SafetensorError and friends
        raise unreadable(path, e) from None


def _read_reference_header(path: Path) -> _ReferenceHeader:
    """The metadata, input ids and points of a reference file; every tensor's shape and dtype are
    checked here so that streaming never meets a malformed one halfway."""

    def bad(why: str) -> BadInput:
        return BadInput(f"{path}: not a surgeon reference: {why}")

    with _open_safetensors(path) as f:
        meta = dict(f.metadata() or {})
        if meta.get("surgeon.kind") != "reference":
            raise bad(f"metadata surgeon.kind is {meta.get('surgeon.kind')!r}, expected 'reference'")
        try:
            L, H = int(meta["num_layers"]), int(meta["hidden_size"])
        except (KeyError, ValueError):
            raise bad("metadata num_layers/hidden_size missing or not integers") from None
        if L < 1 or H < 1:
            raise bad(f"num_layers {L} and hidden_size {H} must be positive")
        names = set(f.keys())
        if "input_ids" not in names:
            raise bad("no 'input_ids' tensor")
        ids = f.get_tensor("input_ids")
        if ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() == 0:
            raise bad(f"'input_ids' must be a non-empty 1-D int64 tensor, got {ids.dtype} {list(ids.shape)}")
        T = int(ids.numel())
        wanted = {str(p): p for p in all_points(L, with_deltas=True)}
        extra = sorted(names - set(wanted) - {"input_ids"})
        if extra:
            raise bad(f"unexpected tensor {extra[0]!r}")
        points = [p for n, p in wanted.items() if n in names]
        if not points:
            raise bad("no point tensors")
        for p in points:
            sl = f.get_slice(str(p))
            shape, dtype = list(sl.get_shape()), sl.get_dtype()
            if shape != [T, H] or dtype not in ("F32", "BF16", "F16", "F64"):
                raise bad(f"{p} is {dtype} {shape}, expected a float [{T}, {H}]")
    return _ReferenceHeader(meta, L, H, ids, points)


def _stream_reference(path: Path, b: _Builder, points: list[Point], T: int, rows: int, window_bytes: int,
                      workers: int | None) -> None:
    """Feed every (point, row chunk) of the file into ``b`` from parallel readers."""
    items = [(c, a) for c in range(len(points)) for a in range(0, T, rows)]
    n_workers = max(1, min(workers or torch.get_num_threads(), len(items)))
    errors: list[BaseException] = []

    def work(mine: list[tuple[int, int]]) -> None:
        f, touched = None, 0
        try:
            for c, a in mine:
                if errors:
                    return
                if f is None or touched >= window_bytes:
                    if f is not None:
                        f.__exit__(None, None, None)  # unmap what was touched so far
                    f, touched = _open_safetensors(path).__enter__(), 0
                x = f.get_slice(str(points[c]))[a : a + rows]
                b.add(c, a, x)
                touched += x.numel() * x.element_size()
                del x
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)
        finally:
            if f is not None:
                f.__exit__(None, None, None)

    # one single-threaded stream per core: page faults of one overlap the other's GEMM
    # (measured 1.35x the throughput of one stream with two intra-op threads)
    run_streams([partial(work, items[w::n_workers]) for w in range(n_workers)])
    if errors:
        raise errors[0]


# -- files ----------------------------------------------------------------------------------------


def save_fingerprint(fp: Fingerprint, path: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Write ``fp`` to one new safetensors file (atomically, never through a link; an existing file
    is replaced only with ``overwrite``)."""
    from safetensors.torch import save

    points = fp.points
    tensors = {
        "input_ids": fp.input_ids.detach().to("cpu", torch.int64).contiguous(),
        "proj": torch.stack([fp.proj[p].to(torch.float32) for p in points]).contiguous(),
        "norms": torch.stack([fp.norms[p].to(torch.float32) for p in points]).contiguous(),
        "first": torch.stack([fp.first[p].to(torch.float32) for p in points]).contiguous(),
    }
    metadata = {
        "surgeon.kind": KIND,
        "surgeon.fingerprint_version": VERSION,
        "projection": PROJECTION,
        "points": json.dumps([str(p) for p in points]),
        "seed": str(int(fp.seed)),
        "dim": str(int(fp.dim)),
        "first_k": str(int(fp.first_k)),
        "num_layers": str(int(fp.num_layers)),
        "hidden_size": str(int(fp.hidden_size)),
        "source": str(fp.source),
    }
    write_file(path, save(tensors, metadata=metadata), overwrite=overwrite, what="the fingerprint file")


def load_fingerprint(path: str | os.PathLike) -> Fingerprint:
    """Read a file written by :func:`save_fingerprint`; anything malformed raises a one-line
    BadInput."""
    path = Path(path)
    tensors, meta = read_safetensors(path)

    def bad(why: str) -> BadInput:
        return BadInput(f"{path}: not a surgeon fingerprint: {why}")

    if meta.get("surgeon.kind") != KIND:
        raise bad(f"metadata surgeon.kind is {meta.get('surgeon.kind')!r}, expected {KIND!r}")
    if meta.get("surgeon.fingerprint_version") != VERSION:
        raise bad(f"fingerprint version {meta.get('surgeon.fingerprint_version')!r}, this surgeon reads {VERSION!r}")
    if meta.get("projection") != PROJECTION:
        raise bad(f"projection {meta.get('projection')!r}, this surgeon uses {PROJECTION!r}")
    ints = {}
    for key in ("seed", "dim", "first_k", "num_layers", "hidden_size"):
        try:
            ints[key] = int(meta[key])
        except KeyError:
            raise bad(f"metadata has no {key!r}") from None
        except ValueError:
            raise bad(f"metadata {key} is {meta[key]!r}, not an integer") from None
    L, H, dim, k = ints["num_layers"], ints["hidden_size"], ints["dim"], ints["first_k"]
    if L < 1 or H < 1 or dim < 1 or k < 0 or dim > H or k > H:
        raise bad(f"inconsistent sizes (num_layers={L}, hidden_size={H}, dim={dim}, first_k={k})")
    try:
        names = json.loads(meta.get("points", ""))
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ValueError
        points = [parse_point(n, L, allow_delta=True) for n in names]
    except (ValueError, PointError):
        raise bad("metadata 'points' is not a JSON list of points of this model") from None
    if len(set(points)) != len(points):
        raise bad("metadata 'points' lists a point twice")
    for key in ("input_ids", "proj", "norms", "first"):
        if key not in tensors:
            raise bad(f"no {key!r} tensor")
    extra = sorted(set(tensors) - {"input_ids", "proj", "norms", "first"})
    if extra:
        raise bad(f"unexpected tensor {extra[0]!r}")
    ids = tensors["input_ids"]
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() == 0:
        raise bad(f"'input_ids' must be a non-empty 1-D int64 tensor, got {ids.dtype} {list(ids.shape)}")
    T, C = int(ids.numel()), len(points)
    for key, shape in (("proj", [C, T, dim]), ("norms", [C, T]), ("first", [C, T, k])):
        t = tensors[key]
        if t.dtype != torch.float32 or list(t.shape) != shape:
            raise bad(f"{key} is {t.dtype} {list(t.shape)}, expected float32 {shape}")
    proj, norms, first = tensors["proj"], tensors["norms"], tensors["first"]
    return Fingerprint(
        seed=ints["seed"], dim=dim, first_k=k, input_ids=ids, num_layers=L, hidden_size=H,
        source=meta.get("source", str(path)),
        proj={p: proj[i] for i, p in enumerate(points)},
        norms={p: norms[i] for i, p in enumerate(points)},
        first={p: first[i] for i, p in enumerate(points)},
    )
