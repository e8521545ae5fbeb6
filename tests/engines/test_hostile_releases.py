"""The releases cache of ``upgrade-check`` and copies of engine trees under hostile conditions
(issue 36: caches that cannot lie, engine sources that cannot hang).

A release unpacked into ``$XDG_CACHE_HOME/surgeon/releases`` decides what ``upgrade-check`` reads:
a file edited, added, linked or made a FIFO there is never read as the release (its digest
manifest says so, a note names the file, the release is fetched again); a cache directory others
may write or another user owns is neither read nor written (one line, exit 2). A FIFO, a device
link, a link to nothing or to a directory in an engine tree is left out of a copy with a note,
never waited on.

The releases are real: a wheel is built from the files of a release scripts/fetch-engines unpacked
(speculators 0.9.0, 1 MB; the smallest of .engines/) and handed to :func:`releases.fetch` in place
of pip's download; the engine trees are copies of the installed SGLang. Every run a regression
could hang is bounded (an alarm, or a subprocess with a timeout).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from surgeon.cli import main
from surgeon.engines.source import releases
from surgeon.engines.source.locate import copy_engine_sources

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / ".engines" / "speculators-0.9.0"
DIST, VERSION = "speculators", "0.9.0"
VLLM_34 = REPO / ".engines" / "vllm-0.34.0" / "vllm"
SPEC = REPO / "specs" / "kimi-k2.5-eagle3.yaml"


def notes(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("surgeon: note: ")]


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    monkeypatch.setattr(releases, "_noted", set())  # each test sees its own notes (said once per process)


@pytest.fixture
def wheel(tmp_path_factory) -> Path:
    """A wheel of the real files of speculators 0.9.0 (as scripts/fetch-engines unpacked them)."""
    if not (SOURCE / releases.STAMP).is_file():
        pytest.skip("speculators 0.9.0 not fetched (scripts/fetch-engines)")
    out = tmp_path_factory.mktemp("wheel") / f"{DIST}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as zf:
        for path in sorted(SOURCE.rglob("*")):
            rel = path.relative_to(SOURCE).as_posix()
            if path.is_file() and rel not in (releases.STAMP, releases.MANIFEST):
                zf.write(path, rel)
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch, wheel) -> dict:
    """The user's cache under a fresh ``XDG_CACHE_HOME``; pip's download replaced by the wheel above,
    counted."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    downloads: list[str] = []

    def download(dist, version, into, *, quiet_pip=False):
        downloads.append(f"{dist}=={version}")
        into.mkdir(parents=True, exist_ok=True)
        target = into / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    monkeypatch.setattr(releases, "download", download)
    return {"dir": releases.cache_dir(), "downloads": downloads}


def fetched(cache: dict) -> Path:
    folder, n = releases.fetch(DIST, VERSION, cache["dir"])
    assert n is not None and n > 10 and cache["downloads"] == [f"{DIST}=={VERSION}"]
    return folder


# -- digests ---------------------------------------------------------------------------------------
def test_a_fetched_release_records_the_digest_of_every_file_and_is_reused_silently(cache, capsys):
    folder = fetched(cache)
    listed = {line.split("  ", 1)[1] for line in (folder / releases.MANIFEST).read_text().splitlines()}
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert listed == files - {releases.STAMP, releases.MANIFEST} and len(listed) > 10
    assert releases.cached(DIST, VERSION, cache["dir"]) == folder
    assert releases.fetch(DIST, VERSION, cache["dir"]) == (folder, None)
    assert cache["downloads"] == [f"{DIST}=={VERSION}"] and notes(capsys.readouterr().err) == []
    for d in (cache["dir"], cache["dir"].parent):  # private, as the probe cache
        assert d.stat().st_mode & 0o777 == 0o700


def _edit(folder: Path) -> str:
    victim = sorted(folder.rglob("*.py"))[0]
    victim.write_text(victim.read_text() + "\nEAGLE3_LAYERS = (1, 2, 3)\n")
    return victim.relative_to(folder).as_posix()


def _add(folder: Path) -> str:
    (folder / DIST / "planted.py").write_text("x = 1\n")
    return f"{DIST}/planted.py"


def _fifo(folder: Path) -> str:
    os.mkfifo(folder / DIST / "zz_fifo.py")
    return "FIFO"


def _link(folder: Path) -> str:
    victim = sorted(folder.rglob("*.py"))[0]
    victim.unlink()
    victim.symlink_to("/dev/zero")
    return "symbolic link"


def _remove(folder: Path) -> str:
    victim = sorted(folder.rglob("*.py"))[-1]
    victim.unlink()
    return victim.relative_to(folder).as_posix() + " is missing"


@pytest.mark.parametrize("damage", [_edit, _add, _fifo, _link, _remove])
def test_a_changed_release_is_said_and_fetched_again_never_used(cache, capsys, damage):
    folder = fetched(cache)
    said = damage(folder)
    signal.alarm(60)  # a FIFO read would wait for a writer: fail, never hang
    try:
        assert releases.cached(DIST, VERSION, cache["dir"]) is None
        again, n = releases.fetch(DIST, VERSION, cache["dir"])
    finally:
        signal.alarm(0)
    assert again == folder and n is not None and len(cache["downloads"]) == 2
    (note,) = notes(capsys.readouterr().err)  # said once, naming the release and what differs
    assert str(folder) in note and said in note, note
    assert releases.cached(DIST, VERSION, cache["dir"]) == folder  # whole again: the fresh release
    assert not (folder / DIST / "planted.py").exists() and not (folder / DIST / "zz_fifo.py").exists()


def test_a_release_linked_into_the_cache_and_changed_is_unlinked_not_deleted(cache, tmp_path, capsys):
    """A release folder that is the user's link to another folder (as the tests link .engines/):
    when it no longer matches, the link is replaced by a fresh release; its target is left as is."""
    elsewhere = fetched(cache).rename(tmp_path / "elsewhere")
    link = releases.release_dir(DIST, VERSION, cache["dir"])
    link.symlink_to(elsewhere, target_is_directory=True)
    assert releases.cached(DIST, VERSION, cache["dir"]) == link  # followed: the user's own link
    _add(elsewhere)
    folder, n = releases.fetch(DIST, VERSION, cache["dir"])
    assert n is not None and not folder.is_symlink() and (elsewhere / DIST / "planted.py").is_file()


def test_a_complete_release_without_a_manifest_records_one_on_first_use(cache, capsys):
    """A release fetched by an older surgeon (or .engines/ of a checkout): used, its digests
    recorded then (with a note), checked from then on."""
    folder = fetched(cache)
    (folder / releases.MANIFEST).unlink()
    assert releases.cached(DIST, VERSION, cache["dir"]) == folder
    (note,) = notes(capsys.readouterr().err)
    assert "recorded the digests" in note and str(folder) in note
    assert (folder / releases.MANIFEST).is_file()
    said = _edit(folder)
    assert releases.cached(DIST, VERSION, cache["dir"]) is None and said in capsys.readouterr().err


def test_a_manifest_that_is_a_link_or_garbage_is_not_believed(cache, tmp_path, capsys):
    folder = fetched(cache)
    forged = tmp_path / "forged"
    forged.write_text("")
    (folder / releases.MANIFEST).unlink()
    (folder / releases.MANIFEST).symlink_to(forged)
    assert releases.cached(DIST, VERSION, cache["dir"]) is None
    assert "symbolic link" in capsys.readouterr().err
    (folder / releases.MANIFEST).unlink()
    (folder / releases.MANIFEST).write_text("not a digest line\n")
    assert releases.cached(DIST, VERSION, cache["dir"]) is None
    assert "not a digest manifest" in capsys.readouterr().err


# -- owner and mode --------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["releases", "surgeon"])
def test_a_cache_others_may_write_is_neither_read_nor_written(cache, capsys, which):
    folder = fetched(cache)
    d = cache["dir"] if which == "releases" else cache["dir"].parent
    d.chmod(0o777)
    assert releases.cached(DIST, VERSION, cache["dir"]) is None
    assert "writable by group or others (mode 0777)" in capsys.readouterr().err
    (folder / releases.STAMP).unlink()  # not there: fetch would put it, but not in that directory
    with pytest.raises(releases.ReleaseError, match=r"not using the releases cache \(.*writable by group or others"):
        releases.fetch(DIST, VERSION, cache["dir"])
    assert len(cache["downloads"]) == 1


def test_a_release_folder_others_may_write_is_not_read(cache, capsys):
    folder = fetched(cache)
    folder.chmod(0o777)
    assert releases.cached(DIST, VERSION, cache["dir"]) is None
    assert f"{folder}: writable by group or others (mode 0777)" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_cache_of_another_user_is_not_read(cache, capsys):
    fetched(cache)
    os.chown(cache["dir"], 65534, 65534)
    assert releases.cached(DIST, VERSION, cache["dir"]) is None
    assert "owned by uid 65534" in capsys.readouterr().err


def test_upgrade_check_from_a_cache_others_may_write_is_one_line_exit_2(tmp_path, monkeypatch):
    if not VLLM_34.is_dir():
        pytest.skip("vllm 0.34.0 not fetched (scripts/fetch-engines)")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    d = releases.cache_dir()
    d.mkdir(parents=True)
    d.chmod(0o777)
    monkeypatch.setattr(releases, "download", lambda *a, **k: pytest.fail("pip was asked into an untrusted cache"))
    res = CliRunner().invoke(main, ["upgrade-check", str(SPEC), "--engine", "vllm", "--from", "0.33.0",
                                    "--to", str(VLLM_34)])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines() == [
        f"surgeon: vllm 0.33.0: not using the releases cache ({d}: writable by group or others (mode 0777)); "
        "fix its owner or mode, or set XDG_CACHE_HOME"]


def test_the_checkout_engines_are_not_held_to_the_cache_rule():
    """.engines/ sits among surgeon's own source: its owner and mode are the checkout's, not
    checked (a group-writable checkout still runs scripts/fetch-engines)."""
    assert releases._untrusted(REPO / ".engines") is None


# -- copies of engine trees ---------------------------------------------------------------------------
def test_a_copy_of_an_engine_tree_leaves_out_fifos_devices_and_odd_links_without_waiting(tmp_path):
    """A FIFO, a link to /dev/zero, a link to nothing and a link to / among the model files of a
    copy of the installed SGLang: copied again (in a subprocess with a timeout: a regression would
    wait on the FIFO or read /dev/zero without end), each is left out with a note, every model
    file is copied."""
    first = copy_engine_sources("sglang", tmp_path / "a")
    models = first / "srt" / "models"
    real = sorted(p.name for p in models.iterdir())
    os.mkfifo(models / "zz_fifo.py")
    (models / "zz_zero.py").symlink_to("/dev/zero")
    (models / "zz_nothing.py").symlink_to(tmp_path / "nothing")
    (models / "zz_root").symlink_to("/", target_is_directory=True)
    code = ("import sys; from surgeon.engines.source.locate import copy_engine_sources; "
            "print(copy_engine_sources('sglang', sys.argv[1], root=sys.argv[2]))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b"), str(first)], capture_output=True,
                       text=True, timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    copied = Path(r.stdout.strip()) / "srt" / "models"
    assert sorted(p.name for p in copied.iterdir() if p.name != "__pycache__") == real
    said = {line.split(": ")[2].split(":")[0].rsplit("/", 1)[-1]: line for line in notes(r.stderr)}
    assert set(said) == {"zz_fifo.py", "zz_zero.py", "zz_nothing.py", "zz_root"}, r.stderr
    assert "FIFO" in said["zz_fifo.py"] and "character device" in said["zz_zero.py"]
    assert "link to nothing" in said["zz_nothing.py"] and "link to a directory" in said["zz_root"]
