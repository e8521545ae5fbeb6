"""Suite-wide fixtures: real engine copies, the gpu skip, and the slow marker's meaning.

Engines come from one place. Tests that edit an engine work on a copy of the *installed* engine
(found with :mod:`surgeon.engines.locate`, never a hard-coded site-packages path), made by the
``engine_copy`` fixture below; a missing engine is a setup error that fails loudly, never a skip.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from surgeon.engines.locate import EngineLocation, ProbeError, locate_engine

pytest_plugins = ["pytester"]


def installed_engine(engine: str) -> EngineLocation:
    """The installed ``engine``, as every command finds it; fails (not skips) when it is absent,
    because scripts/setup installs both engines and a silently skipped suite proves nothing."""
    try:
        return locate_engine(engine)
    except ProbeError as e:
        pytest.fail(f"{engine} is not installed ({e}): run ./scripts/setup", pytrace=False)


RELEASES_DIR = Path(__file__).resolve().parents[1] / ".engines"
RELEASES_LIST = Path(__file__).resolve().parents[1] / "scripts" / "engine-releases.txt"


def engine_releases() -> list[tuple[str, str]]:
    """(distribution, version) of every release in scripts/engine-releases.txt, in file order."""
    out = []
    for line in RELEASES_LIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            dist, version = line.split()
            out.append((dist, version))
    return out


def release_engine(dist: str, version: str) -> Path:
    """The package directory of an engine release fetched as sources by scripts/fetch-engines
    (``.engines/vllm-0.33.0/vllm``); fails (not skips) when it was not fetched."""
    folder = RELEASES_DIR / f"{dist}-{version}"
    if not (folder / ".complete").exists():
        pytest.fail(f"{dist} {version} sources are not in {folder}: run ./scripts/setup", pytrace=False)
    return folder / dist.split("-")[0]


def engine_matrix() -> list[tuple[str, str, Path | None]]:
    """(engine, label, root) for the installed engines (root None) and every fetched release."""
    rows: list[tuple[str, str, Path | None]] = [("vllm", "vllm-installed", None), ("sglang", "sglang-installed", None)]
    for dist, version in engine_releases():
        rows.append((dist.split("-")[0], f"{dist}-{version}", RELEASES_DIR / f"{dist}-{version}" / dist.split("-")[0]))
    return rows


def cli_run(*args, code=0):
    """``surgeon ARGS`` in-process (click's runner): asserts the exit code and that no traceback
    reached the output, and returns the result."""
    from click.testing import CliRunner

    from surgeon.cli import main

    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == code, (res.exit_code, res.output, res.stderr)
    assert "Traceback" not in res.output
    return res


@pytest.fixture
def engine_copy(tmp_path: Path) -> Callable[..., Path]:
    """``engine_copy(engine, dest=None, metadata=True)``: a writable site-packages-like copy of
    the installed engine's model files under ``dest`` (default ``tmp_path/site-<engine>``); returns
    the copied package directory. ``metadata=False`` leaves out the ``*.dist-info`` (a copy whose
    version is unknown). Copies of both engines may share one ``dest``."""
    from surgeon.engines.locate import copy_engine_sources

    def make(engine: str, dest: str | Path | None = None, *, metadata: bool = True) -> Path:
        site = Path(dest) if dest is not None else tmp_path / f"site-{engine}"
        installed_engine(engine)
        before = set(site.glob("*.dist-info"))
        package = copy_engine_sources(engine, site)
        if not metadata:
            for info in set(site.glob("*.dist-info")) - before:
                shutil.rmtree(info)
        return package

    return make


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where CUDA exists; elsewhere they are skipped cleanly. torch
    is imported only when such a test is collected, so a run of the light tests never pays for it."""
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in gpu:
        item.add_marker(skip)
