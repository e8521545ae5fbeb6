"""Run-time data (recipes, specs) found the same way in a checkout and in the built wheel, and an
install without them is an error, never a silently smaller set of recipes."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import surgeon.core.data as data
from surgeon.core.errors import InternalError
from surgeon.patch.recipes import load_recipes

REPO = Path(__file__).resolve().parents[2]
RECIPE_FILES = sorted(p.name for p in (REPO / "patches").glob("*.yaml"))
SPEC_FILES = sorted(p.name for p in (REPO / "specs").glob("*.yaml"))


def test_a_checkout_reads_the_top_level_folders():
    assert data.data_dir("patches") == REPO / "patches"
    assert data.data_file("specs", "demo-tiny-llama-eagle3.yaml") == REPO / "specs" / "demo-tiny-llama-eagle3.yaml"
    assert [str(p) for p in data.data_locations("patches")] == [str(REPO / "surgeon" / "_data" / "patches"),
                                                               str(REPO / "patches")]
    assert len(load_recipes()) >= len(RECIPE_FILES) >= 3  # chatglm, qwen3-vl, lfm2: classes coverage would lose


def _package_at(tmp_path: Path, monkeypatch, *, with_patches: bool) -> Path:
    """surgeon as if installed at tmp_path/site/surgeon (no checkout around it)."""
    pkg = tmp_path / "site" / "surgeon"
    pkg.mkdir(parents=True)
    if with_patches:
        (pkg / "_data" / "patches").mkdir(parents=True)
    monkeypatch.setattr(data, "files", lambda name: pkg)
    return pkg


def test_no_data_folder_is_an_internal_error_naming_where_it_looked(tmp_path, monkeypatch):
    pkg = _package_at(tmp_path, monkeypatch, with_patches=False)
    with pytest.raises(InternalError, match="looked in .*site/surgeon/_data/patches") as e:
        load_recipes()
    assert e.value.exit_code == 1
    with pytest.raises(InternalError, match="demo-tiny"):
        (pkg / "_data" / "specs").mkdir(parents=True)
        data.data_file("specs", "demo-tiny-llama-eagle3.yaml")


def test_zero_recipes_is_an_error(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no patch recipes"):
        load_recipes(tmp_path)  # a folder the caller chose: bad input where it comes from the user
    _package_at(tmp_path, monkeypatch, with_patches=True)
    with pytest.raises(InternalError, match="no patch recipes .*site/surgeon/_data/patches"):
        load_recipes()  # the shipped folder, empty: a broken install


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("*.whl")
    return whl


@pytest.mark.slow
def test_the_wheel_carries_recipes_specs_and_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"surgeon/_data/patches/{n}" for n in RECIPE_FILES} <= names
    assert {f"surgeon/_data/specs/{n}" for n in SPEC_FILES} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("patches/", "specs/", "tests/")) for n in names)


@pytest.mark.slow
def test_the_wheel_finds_its_data_with_importlib_resources(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("from surgeon.core.data import data_dir, data_file; from surgeon.patch.recipes import load_recipes; "
            "print(data_dir('patches')); print(len(load_recipes())); print(data_file('specs', 'demo-tiny-llama-eagle3.yaml'))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    where, count, demo = r.stdout.split()
    assert where == str(site / "surgeon" / "_data" / "patches")
    assert int(count) == len(load_recipes())
    assert demo == str(site / "surgeon" / "_data" / "specs" / "demo-tiny-llama-eagle3.yaml")
