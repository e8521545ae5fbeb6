"""Run-time data: the patch recipes (``patches/``) and the example specs (``specs/``, the demo's).

Both folders stay at the top of the repository (the layout's data). A built wheel carries them as
``surgeon/_data/patches`` and ``surgeon/_data/specs`` (``setup.py`` maps them there), found with
:mod:`importlib.resources`; a checkout or an editable install has no ``surgeon/_data`` and reads
the repository's own folders, next to the package. Data that is in neither place is an internal
error naming both: a broken install, never a silently smaller set of recipes.
"""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Literal

from surgeon.core.errors import InternalError

DataKind = Literal["patches", "specs"]
__all__ = ["DataKind", "data_dir", "data_file", "data_locations"]


def data_locations(kind: DataKind) -> list[Traversable]:
    """Where ``kind`` is looked for, in order: the installed package's ``_data/<kind>``, then the
    checkout's top-level ``<kind>/`` (only where the package sits in a checkout: a
    ``pyproject.toml`` beside it)."""
    package = files("surgeon")
    places: list[Traversable] = [package / "_data" / kind]
    if isinstance(package, Path) and (package.parent / "pyproject.toml").is_file():
        places.append(package.parent / kind)
    return places


def data_dir(kind: DataKind) -> Traversable:
    """The first of :func:`data_locations` that is a folder; InternalError naming each place looked."""
    places = data_locations(kind)
    for place in places:
        if place.is_dir():
            return place
    raise InternalError(f"surgeon's {kind} data is missing (looked in {', '.join(str(p) for p in places)}): "
                        "the install is incomplete; reinstall surgeon")


def data_file(kind: DataKind, name: str) -> Traversable:
    """``name`` in :func:`data_dir`; InternalError when the folder lacks it."""
    folder = data_dir(kind)
    f = folder / name
    if not f.is_file():
        raise InternalError(f"surgeon's {kind} data has no {name} (looked in {folder}): the install is incomplete; "
                            "reinstall surgeon")
    return f
