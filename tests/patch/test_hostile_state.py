"""The patch state, round two (issue 36, items 1 and 3), on copies of the real vLLM engine files:
a lock hard-linked to a file outside the root, ``.surgeon`` swapped for a link between the check
and the use (at each step of an apply, deterministically, through a hook), engine roots and
directories anyone may write, and a state directory reached from a root it does not belong to
(a copy with ``cp -a``, a bind mount inside ``unshare -m``, one made by an earlier surgeon).

Each asserts exit 2 (or doctor's exit 3 with the finding), one line naming the path, no
traceback, and that nothing was written outside: the victim's bytes, the link target's emptiness,
the other root's state byte for byte."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from surgeon.patch import journal as journal_module
from surgeon.patch.statedir import DirHandle
from tests.patch.test_state_safety import REPO, STATE, apply, one_line_error, run, tree

pytestmark = pytest.mark.engine


@pytest.fixture
def vroot(engine_copy) -> Path:
    return engine_copy("vllm")


# ------------------------------------------------------------------------------------------ hard links
@pytest.mark.parametrize("verb", ["apply", "revert", "doctor --repair"])
def test_a_lock_hard_linked_outside_is_refused_and_never_truncated(vroot: Path, tmp_path: Path, verb: str):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    apply(vroot)
    lock = vroot / STATE / "lock"
    lock.unlink()
    os.link(victim, lock)  # (same filesystem: both under tmp_path)
    before = tree(vroot, state=True)
    r = apply(vroot, "--replace", code=2) if verb == "apply" else run(vroot, *verb.split(), code=2)
    err = one_line_error(r)
    assert f"{STATE}/lock: has 2 hard links" in err, err
    assert victim.read_text() == "precious\n" and tree(vroot, state=True) == before
    run(vroot, "status", code=0)  # reading takes a shared lock on it and writes nothing
    assert victim.read_text() == "precious\n"


def test_the_lock_is_written_in_place_never_truncated(vroot: Path):
    """The holder's pid is written over a fixed width and blanked afterwards: the file never shrinks."""
    apply(vroot)
    lock = vroot / STATE / "lock"
    size = lock.stat().st_size
    assert size > 0 and lock.read_bytes().strip() == b""
    run(vroot, "revert", code=0)
    assert lock.stat().st_size == size


# ------------------------------------------------------------------------------------------ swaps
def _swapper(vroot: Path, tmp_path: Path) -> tuple[Path, Path, Callable[[], None]]:
    """(link target, where the real state directory goes, swap()): swap() moves ``.surgeon`` away
    (same filesystem) and puts a link to an empty outside directory in its place."""
    outside, moved = tmp_path / "elsewhere", tmp_path / "moved-state"
    outside.mkdir()

    def swap() -> None:
        os.rename(vroot / STATE, moved)
        (vroot / STATE).symlink_to(outside)

    return outside, moved, swap


@pytest.mark.parametrize("step", ["opened", "blobs", "journal", "file"])
def test_state_dir_swapped_for_a_link_mid_apply_never_redirects_a_write(vroot: Path, tmp_path: Path, monkeypatch,
                                                                        step: str):
    """``.surgeon`` replaced by a link to an outside directory right after it was checked and
    opened, after the blobs were stored, after the journal was written, after the first engine
    file was replaced: exit 2, the link target stays empty, every engine file as before (a swap
    after engine files changed is rolled back through the directory surgeon still holds)."""
    pristine = tree(vroot)
    outside, moved, swap = _swapper(vroot, tmp_path)
    done = []
    if step == "opened":
        real_sub = DirHandle.sub

        def sub(self, name, **kw):
            h = real_sub(self, name, **kw)
            if name == STATE and kw.get("create") and not done:
                done.append(swap())
            return h

        monkeypatch.setattr(DirHandle, "sub", sub)
    else:
        real_step = journal_module._FaultInjection.step

        def at(self, what):
            real_step(self, what)
            if what == step and not done:
                done.append(swap())

        monkeypatch.setattr(journal_module._FaultInjection, "step", at)
    err = one_line_error(apply(vroot, code=2))
    assert done and f"{vroot / STATE}: moved or replaced while surgeon held it open" in err, err
    monkeypatch.undo()
    assert list(outside.iterdir()) == []
    assert tree(vroot) == pristine
    assert not (moved / "journal.json").exists()  # rolled back (or never begun) in the real directory
    assert f"{STATE}: is a symbolic link" in one_line_error(run(vroot, "status", code=2))


# ------------------------------------------------------------------------------------------ modes
def test_an_engine_root_anyone_may_write_is_refused_for_writing(vroot: Path):
    """Mode 0777 without the sticky bit: anyone could swap the engine's files under a patch."""
    pristine = tree(vroot, state=True)
    vroot.chmod(0o777)
    err = one_line_error(apply(vroot, code=2))
    assert f"{vroot}: engine root writable by others (mode 0777, no sticky bit)" in err, err
    assert tree(vroot, state=True) == pristine and not (vroot / STATE).exists()
    run(vroot, "status", code=0)  # reading writes nothing: allowed
    found = json.loads(run(vroot, "doctor", "--json", code=3).stdout)["engines"][0]["findings"]
    assert [f["action"] for f in found] == ["apply and revert refuse it: chmod o-w it"]
    vroot.chmod(0o1777)  # the sticky bit: nobody else may rename or delete what is ours
    apply(vroot, code=0)


def test_a_model_directory_anyone_may_write_is_refused_before_any_write(vroot: Path):
    models = vroot / "model_executor" / "models"
    models.chmod(0o777)
    before = tree(vroot)
    err = one_line_error(apply(vroot, code=2))
    assert f"{models}: writable by others (mode 0777, no sticky bit): anyone could swap model_executor/models/" in err, err
    assert tree(vroot) == before


def test_a_state_dir_anyone_may_write_is_refused(vroot: Path):
    apply(vroot)
    (vroot / STATE).chmod(0o777)
    before = tree(vroot, state=True)
    for args in (["status"], ["revert", "--force"]):
        assert "writable by group or others (mode 0777)" in one_line_error(run(vroot, *args, code=2))
    assert tree(vroot, state=True) == before


# ------------------------------------------------------------------------------------------ root identity
def _refused_everywhere(b: Path, want: str) -> None:
    """Every command on root ``b`` refuses its state (doctor: a finding, exit 3), changing nothing."""
    before = tree(b, state=True)
    for args in (["status"], ["diff"], ["revert"], ["revert", "--force"]):
        assert want in one_line_error(run(b, *args, code=2))
    assert want in one_line_error(apply(b, "--replace", code=2))
    for args in (["doctor"], ["doctor", "--repair"]):
        found = json.loads(run(b, *args, "--json", code=3).stdout)["engines"][0]["findings"]
        assert any(want in f["problem"] for f in found), found
    assert tree(b, state=True) == before


def test_a_state_dir_copied_to_another_root_is_refused_by_every_command(engine_copy, tmp_path: Path):
    a = engine_copy("vllm", tmp_path / "a")
    b = engine_copy("vllm", tmp_path / "b")
    apply(a)
    subprocess.run(["cp", "-a", str(a / STATE), str(b / STATE)], check=True)
    before_a = tree(a, state=True)
    _refused_everywhere(b, f"{b / STATE}: belongs to engine root {a}")
    assert tree(a, state=True) == before_a
    assert json.loads(run(a, "status", "--json", code=0).stdout)["ok"]


def test_a_state_dir_made_by_an_earlier_surgeon_is_adopted_by_its_own_root(vroot: Path):
    apply(vroot)
    record = vroot / STATE / "root.json"
    first = json.loads(record.read_text())
    assert first["root"] == str(vroot) and first["ino"] == vroot.stat().st_ino
    record.unlink()
    run(vroot, "status", code=0)
    assert not record.exists()  # a read writes nothing
    run(vroot, "revert", code=0)
    assert json.loads(record.read_text()) == first


def test_a_legacy_state_dir_copied_to_another_root_is_not_adopted(engine_copy, tmp_path: Path):
    """Without a record, a manifest whose id was made for another root is refused for writing;
    only ``doctor --repair`` (a step taken knowingly, after doctor said why) records this root."""
    a = engine_copy("vllm", tmp_path / "a")
    b = engine_copy("vllm", tmp_path / "b")
    apply(a)
    (a / STATE / "root.json").unlink()
    shutil.copytree(a / STATE, b / STATE, symlinks=True)
    before = tree(b, state=True)
    for args in (["revert", "--force"], ["revert"]):
        assert f"{b / STATE}: records no engine root" in one_line_error(run(b, *args, code=2))
    found = json.loads(run(b, "doctor", "--json", code=3).stdout)["engines"][0]["findings"]
    assert [f["repairable"] for f in found if "records no engine root" in f["problem"]] == [True]
    assert tree(b, state=True) == before


BIND_SCRIPT = """
set -u
mount --bind {a_state} {b_state} || exit 97
mount --bind {a} {c} || exit 98
for args in "status" "diff" "revert" "revert --force" "doctor --repair --json"; do
  {surgeon} $args --engine vllm --engine-root {b} >{out}/"$args".out 2>{out}/"$args".err
  echo "$args=$?" >>{out}/codes
done
{surgeon} status --json --engine vllm --engine-root {c} >{out}/same.out 2>{out}/same.err
echo "same=$?" >>{out}/codes
"""


def test_one_state_dir_bind_mounted_into_two_roots(engine_copy, tmp_path: Path):
    """Root A's ``.surgeon`` bind-mounted at root B's (inside ``unshare -m``): every command on B is
    refused and A's records and stored originals stay byte for byte; A's root mounted whole at C
    (the same directory through another path) is still A's."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -m is not allowed here; the copy test covers the same identity mismatch")
    a = engine_copy("vllm", tmp_path / "a")
    b = engine_copy("vllm", tmp_path / "b")
    c, out = tmp_path / "c", tmp_path / "out"
    for d in (c, out, b / STATE):
        d.mkdir()
    apply(a)
    before_a = tree(a, state=True)
    surgeon = shlex.join([sys.executable, "-m", "surgeon"])
    q = {k: shlex.quote(str(v)) for k, v in dict(a=a, b=b, c=c, out=out, a_state=a / STATE, b_state=b / STATE).items()}
    script = BIND_SCRIPT.format(surgeon=surgeon, **q)
    r = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
    codes = dict(line.split("=") for line in (out / "codes").read_text().splitlines())
    assert codes == {"status": "2", "diff": "2", "revert": "2", "revert --force": "2", "doctor --repair --json": "3",
                     "same": "0"}, codes
    for args in ("status", "diff", "revert", "revert --force"):
        err = (out / f"{args}.err").read_text()
        assert err.startswith(f"surgeon: {b / STATE}: belongs to engine root {a}") and len(err.splitlines()) == 1, err
    assert "belongs to engine root" in (out / "doctor --repair --json.out").read_text()
    assert json.loads((out / "same.out").read_text())["ok"]
    assert tree(a, state=True) == before_a
    assert json.loads(run(a, "status", "--json", code=0).stdout)["ok"]
