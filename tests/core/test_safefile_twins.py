"""One home per concept of the safe-file layer (issue 36): the safe open, the trust rule and the
non-finite guard of ``--json``.

The safe open (``O_NOFOLLOW``/``O_NONBLOCK``, ``fstat`` regular, the caller's check on the
descriptor) is :func:`surgeon.core.safefile.open_at`; the tensor gate, the patch state's directory
handles and the safe-file readers call it and word its refusals each in their own voice. The trust
rule (owned by another user, writable by group or others) is :func:`safefile.distrust`; the probe
cache, the releases cache and the patch state call it. Each is checked here on real files, links
and FIFOs, through the three callers, and the source is checked to hold each idiom once.
"""

from __future__ import annotations

import ast
import json
import os
import time
from pathlib import Path

import pytest

from surgeon.capture.tensorfiles import open_tensor_file, reopen
from surgeon.core import safefile
from surgeon.core.errors import BadInput, InternalError, ReadFailure
from surgeon.core.safefile import UnsafeFile, Voice, distrust, open_at, read_bytes, untrusted_dir
from surgeon.patch.statedir import DirHandle, PatchError, open_dir

SURGEON = Path(__file__).resolve().parents[2] / "surgeon"


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "f"
    os.mkfifo(path)
    return path


# -- the safe open, through its three callers ---------------------------------------------------------
def test_a_fifo_is_refused_at_once_by_every_caller_each_in_its_own_words(tmp_path, fifo):
    started = time.monotonic()
    with pytest.raises(UnsafeFile, match=r"f: the state is a FIFO \(named pipe\), not a regular file"):
        read_bytes(fifo, limit=10, what="the state")
    with pytest.raises(BadInput, match=r"f: is a FIFO \(named pipe\), not a tensor file"):
        open_tensor_file(fifo)
    with open_dir(tmp_path) as d, pytest.raises(PatchError, match=r"f: is a FIFO \(named pipe\) where surgeon keeps"):
        d.open("f", os.O_RDONLY)
    with open_dir(tmp_path) as d, pytest.raises(PatchError, match=r"f: is a FIFO"):
        d.open("f", os.O_WRONLY | os.O_APPEND)  # for writing: a FIFO without a reader
    assert time.monotonic() - started < 5


def test_open_at_refuses_a_link_only_where_links_are_not_followed(tmp_path):
    target = tmp_path / "t"
    target.write_bytes(b"x")
    (tmp_path / "l").symlink_to(target)
    fd, st = open_at(tmp_path / "l", os.O_RDONLY)
    os.close(fd)
    assert st.st_ino == target.stat().st_ino
    with pytest.raises(UnsafeFile, match="l: the file is a symbolic link; surgeon does not follow links here"):
        open_at(tmp_path / "l", os.O_RDONLY, follow=False)
    with open_dir(tmp_path) as d, pytest.raises(PatchError, match="never follows links in its state directory"):
        d.open("l", os.O_RDONLY)


def test_open_at_relative_to_a_directory_handle_is_not_redirected_by_a_swap(tmp_path):
    """The name is opened relative to the held directory: the folder renamed away and a link put in
    its place, the open still reaches the file in the folder held."""
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "x").write_bytes(b"held")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x").write_bytes(b"victim")
    with open_dir(folder) as d:
        folder.rename(tmp_path / "moved")
        folder.symlink_to(elsewhere)
        assert d.read("x") == b"held"
        fd, _ = open_at("x", os.O_RDONLY, dir_fd=d.fd, follow=False)
        assert os.read(fd, 10) == b"held"
        os.close(fd)


def test_the_callers_check_runs_on_the_descriptor_and_closes_it_when_it_refuses(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"x")
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None

    def refuse(st):
        raise BadInput(f"refused inode {st.st_ino}")

    with pytest.raises(BadInput, match=f"refused inode {f.stat().st_ino}"):
        open_at(f, os.O_RDONLY, check=refuse)
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before  # no descriptor leaked


def test_the_gate_reopens_only_the_file_it_read(tmp_path):
    f = tmp_path / "a.safetensors"
    f.write_bytes((2).to_bytes(8, "little") + b"{}")
    gated = open_tensor_file(f)
    os.close(reopen(f, gated.ident))
    other = tmp_path / "other"
    other.write_bytes((2).to_bytes(8, "little") + b"{}")  # made while the first exists: another inode
    os.replace(other, f)
    with pytest.raises(BadInput, match="replaced by another file since its header was read"):
        reopen(f, gated.ident)
    f.unlink()
    os.mkfifo(f)
    with pytest.raises(BadInput, match=r"is a FIFO \(named pipe\) since its header was read"):
        reopen(f, gated.ident)
    f.unlink()
    with pytest.raises(ReadFailure, match="cannot be read"):
        reopen(f, gated.ident)


def test_a_device_is_refused_unopened(monkeypatch):
    """Seen first (``stat``): a device is refused before ``os.open`` (opening some has effects)."""
    opened = []
    real = os.open
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    for voice in (Voice(), Voice(refused=BadInput, what="")):
        with pytest.raises((UnsafeFile, BadInput), match="is a character device"):
            open_at("/dev/zero", os.O_RDONLY, voice=voice)
    assert opened == []


# -- the trust rule -------------------------------------------------------------------------------------
def test_one_trust_rule_for_caches_and_the_patch_state(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o755)
    assert distrust(d, d.stat()) is None and untrusted_dir(d) is None
    d.chmod(0o775)
    why = distrust(d, d.stat())
    assert why == f"{d}: writable by group or others (mode 0775)"
    assert untrusted_dir(d) == why
    with open_dir(tmp_path) as root, pytest.raises(PatchError) as e:
        root.sub("d")
    assert str(e.value).startswith(why + "; refusing to trust it")


# -- one home each, in the source -----------------------------------------------------------------------
def _calls(path: Path, attr: str) -> int:
    tree = ast.parse(path.read_text())
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == attr)


def test_each_idiom_is_written_once():
    """``os.set_blocking`` (the non-blocking open's last step), ``st_uid`` and the group/other
    write bits (the trust rule) live in core/safefile.py only, among the files that had twins."""
    twins = [SURGEON / "capture/tensorfiles.py", SURGEON / "patch/statedir.py", SURGEON / "engines/source/releases.py",
             SURGEON / "engines/source/locate.py"]
    assert _calls(SURGEON / "core/safefile.py", "set_blocking") == 1
    for path in twins:
        text = path.read_text()
        assert _calls(path, "set_blocking") == 0 and _calls(path, "st_uid") == 0, path
        assert "0o022" not in text and "0o002" not in text, path
    assert "st_uid" not in (SURGEON / "engines/probes/cache.py").read_text().split("def _read_secret")[0]


# -- the non-finite guard of --json -------------------------------------------------------------------
def test_the_json_guard_is_the_rule_and_emit_json_only_asserts_it():
    from surgeon.cli_render import emit_json
    from surgeon.commands.outputs.base import non_finite

    assert non_finite({"a": [1.0, {"b": float("inf")}]}) == "a.1.b"  # the rule says where
    with pytest.raises(InternalError, match="cannot be printed as JSON .*surgeon prints no NaN"):
        emit_json({"a": float("nan")})  # a bypass: an internal error, never a bare NaN, never a ValueError
    assert json.loads(json.dumps({"a": 1.5}, allow_nan=False)) == {"a": 1.5}


def test_statedir_keeps_its_public_names():
    from surgeon.patch import statedir

    assert statedir.others_may_write is safefile.others_may_write
    assert statedir.describe_mode is safefile.describe_mode
    assert isinstance(DirHandle, type)
