"""The capture sidecar: what a native route's files hold, written beside them (issue 35, item 2).

vLLM's hidden-state connector (``extract_hidden_states``) writes one ``{request}.safetensors`` per
request, ``hidden_states [T, n, H]`` and ``token_ids [T]``, and records neither the ids it was given
nor which point each row holds. ``surgeon plan`` writes :data:`SIDECAR` into the directory the route
writes to: the spec, engine, release, route and method it planned, the ids handed to the engine as
handed, and per row of the stack, in file order, its point and the spec's capture name. Every reader
of such a file (match, verify, audit, export, dump-info) declares the rows from it
(:func:`find_sidecar`), and refuses a sidecar that does not describe the file.

The file is JSON, read strictly (every field present and typed, no other key; a point that is no
point of the target is refused): a malformed sidecar is one line, ``file:line:col: ...``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from surgeon.core.errors import BadInput
from surgeon.core.points import Point, PointError, parse_point
from surgeon.core.safefile import read_text, write_file

SIDECAR = "surgeon-capture.json"
KIND = "capture-sidecar"  # the file's "surgeon.kind"
ENGINES = ("vllm", "sglang", "trtllm")
ROUTES = ("native", "plugin", "patch")
LAYOUTS = ("vllm-connector",)  # a hidden_states [T, n, H] stack with token_ids [T], rows in file order
VERSIONS = (1,)
LIMIT = 1 << 20  # bytes: a sidecar is a few hundred


@dataclass(frozen=True)
class CaptureSidecar:
    """What the files of one planned capture route hold. ``points`` and ``names`` are per row of the
    written stack (``key``), in file order; ``ids`` are what the engine was handed, as handed."""

    spec: str  # the spec's name
    engine: str  # "vllm" | "sglang" | "trtllm"
    release: str  # the engine version planned for
    route: str  # "native" | "plugin" | "patch"
    method: str  # "extract_hidden_states" | "EAGLE3" | "DFLASH" | ...: what selects the id setter
    model_class: str
    num_layers: int
    ids: tuple[int, ...]
    points: tuple[str, ...]
    names: tuple[str, ...]
    key: str = "hidden_states"
    layout: str = "vllm-connector"
    version: int = 1

    def declared(self) -> list[Point]:
        """Each row's point, parsed against the target's layer count (checked when read)."""
        return [parse_point(p, self.num_layers) for p in self.points]

    def describe(self) -> str:
        return (f"spec {self.spec}, {self.engine} {self.release} {self.route} route ({self.method}, "
                f"{self.model_class}), ids {list(self.ids)}")


def _json(sidecar: CaptureSidecar) -> str:
    body = {"surgeon.kind": KIND, **asdict(sidecar)}
    body["ids"], body["points"], body["names"] = list(sidecar.ids), list(sidecar.points), list(sidecar.names)
    return json.dumps(body, indent=2) + "\n"


def write_sidecar(directory: str | Path, sidecar: CaptureSidecar) -> Path:
    """Write ``sidecar`` as ``directory/surgeon-capture.json`` atomically (never through a link;
    ``directory`` made where it is not yet).
    The same sidecar already there: nothing written (idempotent); a different one: refused, both
    named, the file left as it is. The sidecar is checked as a reader would check it first."""
    path = Path(directory) / SIDECAR
    sidecar = _check(str(path), _json(sidecar), json.loads(_json(sidecar)))  # what is written reads back
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)  # the route writes there later: it may not be yet
        os.lstat(path)
    except FileNotFoundError:
        write_file(path, _json(sidecar).encode("utf-8"), what="the capture sidecar")
        return path
    except OSError as e:
        raise BadInput(f"{path}: cannot inspect the capture sidecar ({e.strerror or e})") from None
    there = read_sidecar(path)
    if there != sidecar:
        raise BadInput(f"{path}: already holds another capture sidecar ({there.describe()}), not this one "
                       f"({sidecar.describe()}): files of two routes would be mixed in one directory; "
                       "capture into a new directory")
    return path


def read_sidecar(path: str | Path) -> CaptureSidecar:
    """The sidecar at ``path``, read strictly; BadInput ``file:line:col: ...`` where it is malformed."""
    p = str(path)
    text = read_text(p, limit=LIMIT, what="the capture sidecar")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"{p}:{e.lineno}:{e.colno}: invalid JSON: {e.msg} (a surgeon capture sidecar)") from None
    return _check(p, text, data)


def find_sidecar(dump_path: str | Path) -> CaptureSidecar | None:
    """The sidecar in ``dump_path``'s directory, or None where there is none; parsed once per
    version of the file (an audit asks for every file of a set)."""
    sidecar = Path(dump_path).parent / SIDECAR
    try:  # the version of the file, as the cache's key (absent: no sidecar)
        st = os.stat(sidecar)
        return _cached(str(sidecar), st.st_ino, st.st_mtime_ns, st.st_size)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BadInput(f"{sidecar}: cannot inspect the capture sidecar ({e.strerror or e})") from None


def rows_of(sidecar: CaptureSidecar, file: str | Path, n_rows: int, key: str, num_layers: int | None) -> list[Point]:
    """The point of each of the ``n_rows`` rows of ``file``'s stack ``key``, as the sidecar beside it
    records them: refused (both named) where the sidecar does not describe the file (another
    tensor, another row count) or another target (``num_layers``: the spec's, where there is one)."""
    where = Path(file).parent / SIDECAR
    if sidecar.key != key:
        raise BadInput(f"{where}: records the rows of tensor {sidecar.key!r}, but {file} stacks its rows in "
                       f"{key!r}: the sidecar does not describe this file")
    if n_rows != len(sidecar.points):
        raise BadInput(f"{where}: records {len(sidecar.points)} rows ({', '.join(sidecar.points)}), but {file} "
                       f"holds {n_rows} in {key!r}: the sidecar does not describe this file")
    if num_layers is not None and num_layers != sidecar.num_layers:
        raise BadInput(f"{where}: records a {sidecar.num_layers}-layer target ({sidecar.model_class}), but the spec's "
                       f"has {num_layers}: {file} was captured from another model")
    return sidecar.declared()


@lru_cache(maxsize=16)
def _cached(path: str, ino: int, mtime_ns: int, size: int) -> CaptureSidecar:
    return read_sidecar(path)


# -- strict reading --------------------------------------------------------------------------------
def _at(text: str, key: str | None) -> str:
    """``line:col`` of ``"key":`` in ``text`` (a field's own place), else of the document's start."""
    m = re.search(r'"' + re.escape(key) + r'"\s*:', text) if key else None
    if m is None:
        return "1:1"
    line = text.count("\n", 0, m.start()) + 1
    return f"{line}:{m.start() - (text.rfind(chr(10), 0, m.start()) + 1) + 1}"


_FIELDS: dict[str, tuple[type, str]] = {
    "spec": (str, "a string"), "engine": (str, "a string"), "release": (str, "a string"), "route": (str, "a string"),
    "method": (str, "a string"), "model_class": (str, "a string"), "num_layers": (int, "an integer"),
    "ids": (list, "a list of integers"), "points": (list, "a list of point names"),
    "names": (list, "a list of capture names"), "key": (str, "a string"), "layout": (str, "a string"),
    "version": (int, "an integer"),
}
_CHOICES = {"engine": ENGINES, "route": ROUTES, "layout": LAYOUTS, "version": VERSIONS}


def _check(p: str, text: str, data: Any) -> CaptureSidecar:
    def bad(key: str | None, why: str) -> BadInput:
        return BadInput(f"{p}:{_at(text, key)}: {why} (a surgeon capture sidecar)")

    if not isinstance(data, dict) or data.get("surgeon.kind") != KIND:
        raise bad("surgeon.kind" if isinstance(data, dict) else None, f'not a capture sidecar: "surgeon.kind" is not "{KIND}"')
    extra = sorted(set(data) - set(_FIELDS) - {"surgeon.kind"})
    if extra:
        raise bad(extra[0], f"unknown key {extra[0]!r} (it holds {', '.join(_FIELDS)})")
    for key, (kind, what) in _FIELDS.items():
        if key not in data:
            raise bad(None, f"no {key!r}")
        value = data[key]
        empty = isinstance(value, str) and not value.strip()
        if not isinstance(value, kind) or isinstance(value, bool) or empty:
            raise bad(key, f"{key!r} is not {what}" + (" (empty)" if empty else ""))
        if key in _CHOICES and value not in _CHOICES[key]:
            raise bad(key, f"{key!r} is {value!r}, not one of {', '.join(map(str, _CHOICES[key]))}")
    _check_lists(data, bad)
    return CaptureSidecar(data["spec"], data["engine"], data["release"], data["route"], data["method"],
                          data["model_class"], data["num_layers"], tuple(data["ids"]), tuple(data["points"]),
                          tuple(data["names"]), data["key"], data["layout"], data["version"])


def _check_lists(data: dict, bad) -> None:
    L = data["num_layers"]
    if L < 1:
        raise bad("num_layers", f"'num_layers' is {L}: a target has at least one layer")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in data["ids"]):
        raise bad("ids", "'ids' is not a list of integers")
    for key in ("points", "names"):
        if not data[key] or not all(isinstance(x, str) and x.strip() for x in data[key]):
            raise bad(key, f"{key!r} is not a non-empty list of non-empty strings")
    if len(data["points"]) != len(data["names"]):
        raise bad("names", f"{len(data['names'])} names for {len(data['points'])} points: one of each per row")
    if len(set(data["names"])) != len(data["names"]):
        raise bad("names", f"a name is given twice in {data['names']}")
    for text in data["points"]:
        try:
            parse_point(text, L)
        except PointError as e:
            raise bad("points", f"point {text!r}: {e.message}") from None
