"""The audit's processes keep their freed heap from file to file and keep the garbage collector off
the objects they start with; both are undone or harmless where they do not apply."""

from __future__ import annotations

import platform
import subprocess
import sys

_FAULTS = """
import resource, sys
import numpy as np
from surgeon.audit.heap import keep_freed
if sys.argv[1] == "keep":
    assert keep_freed()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # a file's arrays: allocated, written, freed
    a = np.ones((4, 64, 2048), np.float32); b = a * a; del a, b
start = faults()
for _ in range(20):
    a = np.ones((4, 64, 2048), np.float32); b = a * a; del a, b
print(faults() - start)
"""


def test_a_file_s_arrays_reuse_the_pages_the_last_file_freed():
    from surgeon.audit.heap import keep_freed

    if not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"):
        assert keep_freed() is False  # another malloc: left as it is
        return

    def faults(mode: str) -> int:
        return int(subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True,
                                  check=True).stdout)

    # 20 rounds of two 2 MB arrays: every page faulted in again by default, next to none once kept
    assert faults("default") > 20 * 512 and faults("keep") < 100


def test_an_owned_process_freezes_once_and_hands_the_objects_back_at_exit():
    code = ("import gc, sys; from surgeon.audit.heap import settle_owned; settle_owned(); n = gc.get_freeze_count(); "
            "settle_owned(); assert n > 1000 and gc.get_freeze_count() == n, n; import atexit; atexit._run_exitfuncs(); "
            "assert gc.get_freeze_count() == 0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_an_audit_in_the_callers_process_leaves_nothing_frozen(speculators_set, tmp_path):
    """One worker: the driver audits; its objects are the collector's again when the run ends."""
    import gc

    from surgeon.audit.pipeline import Plan, run_audit

    assert gc.get_freeze_count() == 0
    rep = run_audit(Plan(speculators_set.root, str(speculators_set.spec), workers=1, exact_files=0,
                         state_path=tmp_path / "s.jsonl", structure_only=False))
    assert rep.files == 60 and gc.get_freeze_count() == 0


def test_an_inline_run_leaves_a_freeze_the_caller_made_and_nested_runs_unfreeze_once():
    code = ("import gc; from surgeon.audit.heap import settled; gc.freeze(); n = gc.get_freeze_count()\n"
            "with settled(): pass\n"
            "assert gc.get_freeze_count() > n - 100, 'the caller freeze was lifted'\n"
            "gc.unfreeze()\n"
            "with settled():\n"
            "    k = gc.get_freeze_count()\n"
            "    with settled(): pass\n"
            "    assert gc.get_freeze_count() > k - 100 > 0, 'an inner run lifted the outer one'\n"
            "assert gc.get_freeze_count() == 0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_a_run_that_fails_midway_hands_its_freeze_back_at_once(speculators_set, tmp_path):
    """An error in the driver's loop (here the progress callback) closes the executor then, not when
    the caller lets go of the traceback."""
    import gc

    import pytest

    from surgeon.audit.pipeline import Plan, run_audit

    def update(done: int, total: int) -> None:
        if done == 3:
            raise RuntimeError("the consumer failed")

    with pytest.raises(RuntimeError) as caught:
        run_audit(Plan(speculators_set.root, str(speculators_set.spec), workers=1, exact_files=0,
                       state_path=tmp_path / "s.jsonl"), update)
    assert caught.value is not None and gc.get_freeze_count() == 0
