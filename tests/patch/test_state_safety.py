"""The patch state under hostile and careless conditions (issue 13), on copies of the real vLLM
engine files: links and foreign objects in the state directory (a victim file outside the root
stays untouched), every kind of damaged state file (exit 2, one line, no traceback), patched
files found by their markers after the manifest is lost, stacking refused, a state directory
shared through a link, disk full / file too large, a read-only root, Ctrl-C during start-up.

Every CLI run goes through click's CliRunner (in process) or a subprocess; the apply names its
model file and loop class, so no test pays for a probe."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from surgeon.cli import main

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "specs/llama-3.1-8b-eagle3.yaml"
LLAMA = "model_executor/models/llama.py"
HOOKS = "model_executor/models/_surgeon_hooks_llama_3_1_8b_eagle3.py"
STATE = ".surgeon"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(root: Path, *, state: bool = False) -> dict[str, tuple[str, int]]:
    """relpath -> (sha256 or kind, mode) of every node under root (the state directory only when asked)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if not state and rel.parts[0] == STATE:
            continue
        st = p.lstat()
        kind = "link:" + os.readlink(p) if p.is_symlink() else ("dir" if p.is_dir() else sha(p))
        out[str(rel)] = (kind, st.st_mode)
    return out


def run(root: Path, *args: str, code: int | None = None):
    """``surgeon <args> --engine vllm --engine-root root``; asserts the exit code and no traceback."""
    r = CliRunner().invoke(main, [*map(str, args), "--engine", "vllm", "--engine-root", str(root)])
    text = r.output + (r.stderr if hasattr(r, "stderr") else "")
    assert "Traceback" not in text and not isinstance(r.exception, AssertionError), text
    if code is not None:
        assert r.exit_code == code, (r.exit_code, text)
    return r


def apply(root: Path, *extra: str, code: int = 0):
    return run(root, "apply", SPEC, "--model-file", LLAMA, "--loop-class", "LlamaModel", *extra, code=code)


def one_line_error(r) -> str:
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("surgeon: "), err
    return err


@pytest.fixture
def vroot(engine_copy) -> Path:
    return engine_copy("vllm")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside every engine root, which no surgeon command may ever change."""
    v = tmp_path / "victim.txt"
    v.write_text("precious\n")
    return v


# ------------------------------------------------------------------------------------------ links
@pytest.mark.parametrize("verb", ["status", "apply", "revert", "diff", "doctor"])
def test_a_lock_linked_outside_the_root_is_refused_and_its_target_untouched(vroot: Path, victim: Path, verb: str):
    (vroot / STATE).mkdir()
    (vroot / STATE / "lock").symlink_to(victim)
    before = tree(vroot)
    r = apply(vroot, code=2) if verb == "apply" else run(vroot, verb, code=3 if verb == "doctor" else 2)
    if verb != "doctor":
        assert f"{STATE}/lock: is a symbolic link" in one_line_error(r)
    else:
        assert f"{STATE}/lock: is a symbolic link" in r.stdout
    assert victim.read_text() == "precious\n" and tree(vroot) == before


def test_a_state_dir_linked_outside_the_root_is_refused_and_nothing_is_written_there(vroot: Path, tmp_path: Path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (vroot / STATE).symlink_to(outside)
    before = tree(vroot)
    assert f"{STATE}: is a symbolic link" in one_line_error(apply(vroot, code=2))
    assert f"{STATE}: is a symbolic link" in one_line_error(run(vroot, "status", code=2))
    assert list(outside.iterdir()) == [] and tree(vroot) == before


def test_originals_linked_outside_the_root_is_refused_before_any_engine_file_changes(vroot: Path, tmp_path: Path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (vroot / STATE).mkdir()
    (vroot / STATE / "originals").symlink_to(outside)
    before = tree(vroot)
    assert f"{STATE}/originals: is a symbolic link" in one_line_error(apply(vroot, code=2))
    assert list(outside.iterdir()) == [] and tree(vroot) == before


def test_a_manifest_linked_to_a_victim_is_neither_read_nor_replaced(vroot: Path, victim: Path):
    apply(vroot)
    manifest = vroot / STATE / "manifest.json"
    manifest.unlink()
    manifest.symlink_to(victim)
    assert "manifest.json: is a symbolic link" in one_line_error(run(vroot, "revert", code=2))
    assert manifest.is_symlink() and victim.read_text() == "precious\n"


@pytest.mark.parametrize("kind", ["fifo", "foreign owner", "group writable"])
def test_foreign_objects_in_the_state_dir_are_refused(vroot: Path, kind: str):
    apply(vroot)
    state = vroot / STATE
    if kind == "fifo":  # a FIFO is refused, never opened (opening one for reading would hang)
        (state / "manifest.json").unlink()
        os.mkfifo(state / "manifest.json")
        want = "manifest.json: is a FIFO"
    elif kind == "foreign owner":
        os.chown(state, 65534, 65534)  # (the tests may run as root: root can give it away)
        want = "owned by uid 65534"
    else:
        state.chmod(0o775)
        want = "writable by group or others (mode 0775)"
    for verb in ("status", "revert"):
        assert want in one_line_error(run(vroot, verb, code=2))
    assert want in one_line_error(apply(vroot, "--replace", code=2))


def test_two_roots_sharing_a_state_dir_through_a_link(engine_copy, tmp_path: Path):
    a = engine_copy("vllm", tmp_path / "a")
    b = engine_copy("vllm", tmp_path / "b")
    apply(a)
    (b / STATE).symlink_to(a / STATE)
    before_a = tree(a, state=True)
    for args in (["status"], ["diff"], ["revert", "--force"]):
        assert f"{b / STATE}: is a symbolic link" in one_line_error(run(b, *args, code=2))
    assert f"{b / STATE}: is a symbolic link" in one_line_error(apply(b, code=2))
    assert tree(a, state=True) == before_a
    assert json.loads(run(a, "status", "--json", code=0).stdout)["ok"]


# ------------------------------------------------------------------------------------------ damage
def _damage(root: Path, how: str) -> str:
    """Damage the state of an applied root; returns the path the error must name."""
    state = root / STATE
    manifest = state / "manifest.json"
    m = json.loads(manifest.read_text())
    if how == "random bytes":
        manifest.write_bytes(bytes(range(256)) * 4)
    elif how == "format only":
        manifest.write_text('{"format": 1}')
    elif how == "patches a list":
        manifest.write_text(json.dumps({"format": 1, "patches": []}))
    elif how == "empty entry":
        manifest.write_text(json.dumps({"format": 1, "patches": {"x": {}}}))
    elif how == "manifest a directory":
        manifest.unlink()
        manifest.mkdir()
    elif how == "hash ../..":
        next(iter(m["patches"].values()))["files"][0]["sha256_before"] = "../.."
        manifest.write_text(json.dumps(m))
    elif how == "relpath outside":
        next(iter(m["patches"].values()))["files"][0]["relpath"] = "../../etc/passwd"
        manifest.write_text(json.dumps(m))
    elif how == "originals a file":
        for blob in (state / "originals").iterdir():
            blob.unlink()
        (state / "originals").rmdir()
        (state / "originals").write_text("x")
        return str(state / "originals")
    elif how == "journal format only":
        (state / "journal.json").write_text('{"format": 1}')
        return str(state / "journal.json")
    return str(manifest)


DAMAGE = ["random bytes", "format only", "patches a list", "empty entry", "manifest a directory", "hash ../..",
          "relpath outside", "originals a file", "journal format only"]


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_state_is_one_line_exit_2_naming_the_file(vroot: Path, how: str):
    apply(vroot)
    where = _damage(vroot, how)
    before = tree(vroot, state=True)
    for verb in ("status", "revert", "diff"):
        err = one_line_error(run(vroot, verb, code=2))
        assert where in err, err
    assert where in one_line_error(apply(vroot, "--replace", code=2))
    doc = run(vroot, "doctor", "--json", code=3)
    assert any(where in f["path"] or where in f["problem"] for f in json.loads(doc.stdout)["engines"][0]["findings"])
    assert tree(vroot, state=True) == before  # nothing read damage as data and wrote from it


# ------------------------------------------------------------------------------------------ markers
def test_a_lost_manifest_leaves_patched_files_reported_and_doctor_restores_them(vroot: Path):
    pristine = tree(vroot)
    apply(vroot)
    assert "# surgeon-patch: name=llama-3.1-8b-eagle3 spec=" in (vroot / LLAMA).read_text()
    (vroot / STATE / "manifest.json").unlink()
    st = run(vroot, "status", "--json", code=3)
    [u] = json.loads(st.stdout)["unrecorded"]
    assert u["relpath"] == LLAMA and u["patch"] == "llama-3.1-8b-eagle3" and u["restorable"]
    assert "patched but unrecorded" in run(vroot, "status", code=3).stderr
    assert "patched but unrecorded" in one_line_error(run(vroot, "revert", "--all", code=2))
    assert "already carries surgeon patch llama-3.1-8b-eagle3" in one_line_error(apply(vroot, "--name", "other", code=2))
    assert json.loads(run(vroot, "doctor", "--json", code=3).stdout)["healthy"] is False
    assert tree(vroot) != pristine  # doctor without --repair changed nothing
    run(vroot, "doctor", "--repair", code=0)
    assert tree(vroot) == pristine  # llama.py byte-identical, the hooks module gone
    assert json.loads(run(vroot, "status", "--json", code=0).stdout)["ok"]


def test_a_deleted_state_dir_is_never_reported_clean(vroot: Path):
    import shutil

    apply(vroot)
    shutil.rmtree(vroot / STATE)
    r = run(vroot, "status", code=3)
    assert "patched but unrecorded" in r.stderr and "reinstall the engine package" in r.stderr
    assert not (vroot / STATE).exists()  # status created nothing
    doc = json.loads(run(vroot, "doctor", "--repair", "--json", code=3).stdout)
    assert "reinstall" in doc["engines"][0]["findings"][0]["action"]


def test_revert_force_then_another_name_does_not_stack(vroot: Path):
    apply(vroot)
    llama = vroot / LLAMA
    llama.write_text(llama.read_text() + "\n# edited by hand\n")  # drift
    run(vroot, "revert", "--force", code=0)  # keeps the drifted file, drops the record
    before = tree(vroot)
    err = one_line_error(apply(vroot, "--name", "other", code=2))
    assert f"{LLAMA}: already carries surgeon patch llama-3.1-8b-eagle3" in err
    assert tree(vroot) == before
    st = run(vroot, "status", code=3)  # and it is not reported clean
    assert "patched but unrecorded" in st.stderr


def test_revert_works_with_the_stored_patched_copies_deleted(vroot: Path):
    import shutil

    pristine = tree(vroot)
    apply(vroot)
    shutil.rmtree(vroot / STATE / "patched")
    assert "--- a/" + LLAMA in run(vroot, "diff", code=0).stdout  # from the file on disk, which hashes as recorded
    doc = json.loads(run(vroot, "doctor", "--json", code=3).stdout)["engines"][0]["findings"]
    assert {f["repairable"] for f in doc} == {True} and len(doc) == 2  # llama.py and the hooks module
    run(vroot, "revert", code=0)  # without them: the files on disk hash as recorded
    assert tree(vroot) == pristine


def test_doctor_rebuilds_lost_patched_copies_from_files_that_hash_as_recorded(vroot: Path):
    import shutil

    apply(vroot)
    stored = sorted(p.name for p in (vroot / STATE / "patched").iterdir())
    shutil.rmtree(vroot / STATE / "patched")
    fixed = json.loads(run(vroot, "doctor", "--repair", "--json", code=0).stdout)["engines"][0]["findings"]
    assert [f["fixed"] for f in fixed] == [True, True]
    assert sorted(p.name for p in (vroot / STATE / "patched").iterdir()) == stored
    assert json.loads(run(vroot, "doctor", "--json", code=0).stdout)["engines"][0]["findings"] == []


# ------------------------------------------------------------------------------------------ disk
FSIZE_CHILD = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
sys.argv = ["surgeon", *sys.argv[2:]]
from surgeon.__main__ import main
main()
"""


@pytest.mark.parametrize("limit", [4096, 21_000])
def test_file_too_large_is_exit_2_naming_the_path_with_nothing_changed(vroot: Path, limit: int):
    """RLIMIT_FSIZE makes a write past ``limit`` bytes fail with EFBIG (Python ignores SIGXFSZ),
    as a full disk would: 4096 fails at the first stored copy, 21000 at the second (vllm 0.32's
    llama.py is 20657 bytes, its patched copy larger). A failure at an engine file's own write is
    test_permission_denied_on_an_engine_file_names_it_and_rolls_back (and test_manifest's ENOSPC)."""
    before = tree(vroot)
    r = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(limit), "apply", str(SPEC), "--engine", "vllm",
                        "--engine-root", str(vroot), "--model-file", LLAMA, "--loop-class", "LlamaModel"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "File too large" in line and str(vroot / STATE) in line, line
    assert tree(vroot) == before
    assert not [p for p in vroot.rglob("*surgeon-tmp*")]
    assert json.loads(run(vroot, "status", "--json", code=0).stdout) == {"format": 1, "ok": True, "patches": [],
                                                                        "unrecorded": [], "recovered": [], "pending": []}


def test_permission_denied_on_an_engine_file_names_it_and_rolls_back(vroot: Path, monkeypatch):
    """EACCES where the engine file is replaced (mocked: the tests may run as root, whom chmod
    does not stop): exit 2 naming the engine file, every file as before."""
    import tempfile

    before = tree(vroot)
    real = tempfile.mkstemp

    def denied(*a, **k):
        if k.get("dir") is not None and STATE not in Path(k["dir"]).parts:
            raise PermissionError(13, "Permission denied")
        return real(*a, **k)

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    err = one_line_error(apply(vroot, code=2))
    assert "rolled back" in err and "Permission denied" in err and str(vroot / "model_executor/models") in err
    monkeypatch.undo()
    assert tree(vroot) == before


# ------------------------------------------------------------------------------------------ read-only
def test_status_on_an_unpatched_root_creates_nothing(vroot: Path):
    before = tree(vroot, state=True)
    for verb in ("status", "doctor"):
        run(vroot, verb, code=0)
    run(vroot, "diff", code=2)
    assert tree(vroot, state=True) == before and not (vroot / STATE).exists()


def test_read_commands_on_a_patched_root_create_and_change_nothing(vroot: Path):
    """status, diff and doctor take a shared lock, or none when the lock file is gone: they never create it."""
    apply(vroot)
    (vroot / STATE / "lock").unlink()
    before = tree(vroot, state=True)
    stamps = {p: p.stat().st_mtime_ns for p in (vroot / STATE).rglob("*")}
    for verb in ("status", "diff", "doctor"):
        run(vroot, verb, code=0)
    assert tree(vroot, state=True) == before and not (vroot / STATE / "lock").exists()
    assert {p: p.stat().st_mtime_ns for p in (vroot / STATE).rglob("*")} == stamps


def _interrupted_apply(root: Path) -> None:
    """An apply killed (os._exit) after its first engine file was replaced: a journal is left."""
    env = dict(os.environ, PYTHONPATH=str(REPO), SURGEON_MANIFEST_TEST_CRASH_AT="3")
    r = subprocess.run([sys.executable, "-m", "surgeon", "apply", str(SPEC), "--engine", "vllm", "--engine-root",
                        str(root), "--model-file", LLAMA, "--loop-class", "LlamaModel"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 99, r.stderr
    assert (root / STATE / "journal.json").exists()


def test_status_reports_the_recovery_it_did(vroot: Path):
    pristine = tree(vroot)
    _interrupted_apply(vroot)
    st = json.loads(run(vroot, "status", "--json", code=0).stdout)
    assert st["recovered"] and "interrupted apply rolled back" in st["recovered"][0]
    assert tree(vroot) == pristine


def test_read_only_root_status_reports_a_pending_transaction_and_writes_nothing(vroot: Path, monkeypatch):
    """What this proves: with os.access saying the state is not writable (mocked, as the tests may
    run as root), status takes no exclusive lock, recovers nothing, writes nothing, and says a
    transaction is pending (exit 3). It does not prove the kernel would refuse a write."""
    _interrupted_apply(vroot)
    before = tree(vroot, state=True)
    stamps = {p: p.stat().st_mtime_ns for p in (vroot / STATE).rglob("*")}
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **k: False if mode & os.W_OK else real(path, mode, **k))
    r = run(vroot, "status", "--json", code=3)
    out = json.loads(r.stdout)
    assert out["pending"] and "journal.json: an interrupted transaction is pending" in out["pending"][0]
    assert "pending" in run(vroot, "status", code=3).stderr
    assert "no surgeon patches applied" in one_line_error(run(vroot, "diff", code=2))  # (nothing committed yet)
    assert json.loads(run(vroot, "doctor", "--json", code=3).stdout)["engines"][0]["findings"][0]["repairable"]
    assert tree(vroot, state=True) == before
    assert {p: p.stat().st_mtime_ns for p in (vroot / STATE).rglob("*")} == stamps


def test_read_only_root_enforced_by_the_kernel(engine_copy):
    """The same, enforced by the kernel: the engine's site folder is bind-mounted read-only in a
    private mount namespace (``unshare --mount``), where even root gets EROFS on any write; status,
    diff and doctor still answer (a shared lock or none, nothing created)."""
    import shlex

    vroot = engine_copy("vllm")
    apply(vroot)
    before = tree(vroot, state=True)
    site = shlex.quote(str(vroot.parent))
    for verb in ("status", "diff", "doctor"):
        cmd = shlex.join([sys.executable, "-m", "surgeon", verb, "--engine", "vllm", "--engine-root", str(vroot), "--json"])
        script = (f"mount --bind {site} {site} && mount -o remount,bind,ro {site} && "
                  f"! touch {site}/.probe-write 2>/dev/null && exec {cmd}")
        r = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, timeout=180,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert r.returncode == 0, (verb, r.stderr)
        assert json.loads(r.stdout)["format"] == 1
    assert tree(vroot, state=True) == before


# ------------------------------------------------------------------------------------------ Ctrl-C
INTERRUPT_AT_IMPORT = r"""
import builtins, runpy, sys
real = builtins.__import__
def imp(name, *a, **k):
    if name == "surgeon.cli":
        raise KeyboardInterrupt
    return real(name, *a, **k)
builtins.__import__ = imp
sys.argv = ["surgeon", "status"]
runpy.run_module("surgeon", run_name="__main__")
"""


def test_ctrl_c_during_start_up_is_one_line_exit_130():
    r = subprocess.run([sys.executable, "-c", INTERRUPT_AT_IMPORT], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 130 and r.stderr == "surgeon: interrupted\n", r.stderr


def test_ctrl_c_during_a_command_is_one_line_exit_130(vroot: Path, monkeypatch):
    from surgeon import commands

    def interrupted(**_):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "status", interrupted)
    r = run(vroot, "status", code=130)
    assert r.stderr == "surgeon: interrupted\n"
