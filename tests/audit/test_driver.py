"""The audit's driver at its edges: a resumed run redoes the stale check as a fresh run would and
keeps its recorded profile whatever was added or removed, a file changed mid-run is audited, not a
crash; bad input (a dead Ray address, a report
folder that is not there, a state file of the wrong shape, ``--exact -1``) is exit 2 before any work
or any write; Ctrl-C stops a pool without a traceback from every worker."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from surgeon.audit.exact import exact_picks as _exact_picks
from surgeon.audit.pipeline import Plan, run_audit
from surgeon.cli import main
from surgeon.commands.outputs import json_output
from surgeon.core.errors import BadInput
from tests.conftest import default_sigint

TIMING = ("seconds", "files_per_s", "mb_per_s", "resumed", "workers", "backend")


def _stable(report) -> dict:
    return {k: v for k, v in json_output("audit", report).items() if k not in TIMING}


def _stale(report) -> set[str]:
    return {Path(o["path"]).name for o in json_output("audit", report)["outliers"]
            if any(f["kind"] == "stale" for f in o["findings"])}


def _cli(*args, code):
    res = CliRunner().invoke(main, ["audit", *map(str, args)])
    assert res.exit_code == code, res.output
    return res


def test_a_resumed_run_redoes_the_stale_check_against_the_files_as_they_are_now(dump_set, tmp_path):
    root = tmp_path / "set"
    shutil.copytree(dump_set.root, root)
    spec, state = str(dump_set.spec), tmp_path / "s.jsonl"
    first = run_audit(Plan(root, spec, state_path=state))
    (detail,) = [f["detail"] for o in json_output("audit", first)["outliers"] for f in o["findings"] if f["kind"] == "stale"]
    source = Path(detail.split(" to rows of ")[1].split(" (slot")[0])
    assert source.parent == root.absolute()
    source.unlink()  # the copy's source gone: the copy is no finding any more
    resumed = run_audit(Plan(root, spec, state_path=state, resume=True))
    fresh = run_audit(Plan(root, spec, state_path=tmp_path / "fresh.jsonl"))
    assert resumed.resumed == 59 and _stale(resumed) == _stale(fresh) == set()
    assert _stable(resumed) == _stable(fresh)


def test_a_file_changed_after_the_resume_began_is_audited_in_its_turn(dump_set, tmp_path, monkeypatch):
    import surgeon.audit.pipeline as pipeline

    state = tmp_path / "s.jsonl"
    first = run_audit(Plan(dump_set.root, str(dump_set.spec), state_path=state))
    real, calls = pipeline._recorded, []

    def changed_after_the_start(st, path, read=True):
        calls.append(read)
        return None if read and len(calls) == 61 + 3 else real(st, path, read)  # the 4th file, at its turn

    monkeypatch.setattr(pipeline, "_recorded", changed_after_the_start)
    again = run_audit(Plan(dump_set.root, str(dump_set.spec), state_path=state, resume=True))
    assert again.resumed == 59 and _stable(again) == _stable(first)


def test_resume_knows_the_files_however_dir_was_typed(dump_set, tmp_path, monkeypatch):
    state = tmp_path / "s.jsonl"
    monkeypatch.chdir(dump_set.root.parent)
    run_audit(Plan(Path(dump_set.root.name), str(dump_set.spec), state_path=state, structure_only=True))
    monkeypatch.chdir(tmp_path)
    again = run_audit(Plan(dump_set.root, str(dump_set.spec), state_path=state, structure_only=True, resume=True))
    assert again.resumed == 60
    other = tmp_path / "moved"
    shutil.copytree(dump_set.root, other, copy_function=os.link)
    moved = run_audit(Plan(other, str(dump_set.spec), state_path=state, structure_only=True, resume=True))
    assert moved.resumed == 0 and any("none of the 60 files the state records" in n for n in moved.notes), moved.notes


@pytest.mark.parametrize("n, k, want", [(3, 8, {0, 1, 2}), (2, 4, {0, 1}), (100, 4, {12, 37, 62, 87}), (5, 0, set()),
                                        (0, 4, set())])
def test_exact_picks_are_spread_and_all_files_where_there_are_fewer(n, k, want):
    assert _exact_picks(n, k) == want


def test_a_dead_ray_address_is_bad_input_before_the_state_is_touched(dump_set, tmp_path):
    import socket

    state = tmp_path / "s.jsonl"
    run_audit(Plan(dump_set.root, str(dump_set.spec), state_path=state, structure_only=True))
    before = state.read_bytes()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    t = time.monotonic()
    with pytest.raises(BadInput, match=f"--ray 127.0.0.1:{port}: cannot connect"):
        run_audit(Plan(dump_set.root, str(dump_set.spec), state_path=state, structure_only=True,
                       ray_address=f"127.0.0.1:{port}"))
    assert time.monotonic() - t < 30 and state.read_bytes() == before
    with pytest.raises(BadInput, match="not HOST:PORT"):
        run_audit(Plan(dump_set.root, str(dump_set.spec), state_path=state, structure_only=True, ray_address="nowhere"))


def test_a_report_into_a_missing_folder_is_bad_input_before_the_audit(dump_set, tmp_path):
    res = _cli(dump_set.root, "--spec", dump_set.spec, "--structure-only", "--state", tmp_path / "s.jsonl",
               "--report", tmp_path / "no" / "r.html", code=2)
    assert "no folder" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "s.jsonl").exists()  # nothing written


def test_a_negative_exact_count_is_a_usage_error(dump_set):
    res = _cli(dump_set.root, "--spec", dump_set.spec, "--exact", "-1", code=2)
    assert "--exact" in res.output


_RECORD = '{"path": "p", "size": 1, "mtime_ns": 1, "slots": [], "hashes": [], "findings": %s}'


@pytest.mark.parametrize("lines, where", [
    (["[1, 2]"], ":1:1:"), (['"x"'], ":1:1:"), (["null"], ":1:1:"),
    (["{header}", '{"a": 1}'], ":2:1:"), (["{header}", "[1]"], ":2:1:"),
    (["{header}", _RECORD % "[]", _RECORD % "[1]"], ":3:1:"),
    # a row hash past int64 (a hand-edited state): the cross-file index would overflow mid-run
    (["{header}", _RECORD.replace('"hashes": []', f'"hashes": [[0, {2**63}, 1, 0]]') % "[]"], ":2:1:"),
])
def test_a_state_file_of_the_wrong_shape_is_bad_input_with_its_line(dump_set, tmp_path, lines, where):
    state = tmp_path / "s.jsonl"
    run_audit(Plan(dump_set.root, str(dump_set.spec), state_path=state, structure_only=True))
    header = state.read_text().splitlines()[0]
    state.write_text("".join((header if x == "{header}" else x) + "\n" for x in lines))
    res = _cli(dump_set.root, "--spec", dump_set.spec, "--structure-only", "--state", state, "--resume", code=2)
    assert f"{state}{where}" in res.output and len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.slow
def test_ctrl_c_stops_a_pool_with_one_line(specforge_set, tiny_target, tmp_path):
    state = tmp_path / "s.jsonl"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    args = ["audit", str(specforge_set.root), "--spec", str(specforge_set.spec), "--reference", f"hf:{tiny_target}",
            "--exact", "160", "--workers", "2", "--state", str(state), "--json"]
    p = subprocess.Popen([sys.executable, "-m", "surgeon", *args], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, start_new_session=True, preexec_fn=default_sigint)
    deadline = time.monotonic() + 60
    while (not state.exists() or len(state.read_bytes().splitlines()) < 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    # as a terminal sends it, to every process of the group, while the workers wait for work (the
    # driver identifies every file exactly, one at a time)
    os.killpg(p.pid, signal.SIGINT)
    err = p.communicate(timeout=60)[1].decode()
    assert p.returncode == 130 and "Traceback" not in err and err.strip().splitlines() == ["surgeon: interrupted"], err


def test_ray_client_and_ipv6_addresses_are_probed_where_they_point(dump_set, tmp_path):
    import socket

    from surgeon.audit.ray_backend import check_address

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        check_address(f"ray://127.0.0.1:{port}")  # a Ray Client server listens there: no error
        check_address(f"localhost:{port}")
    for address in ("auto", "local"):
        check_address(address)  # Ray's to resolve
    with pytest.raises(BadInput, match="cannot connect"):
        check_address(f"ray://127.0.0.1:{port}")


def test_a_resume_keeps_its_profile_when_files_are_added_or_removed(specforge_set, tiny_target, tmp_path):
    root = tmp_path / "set"
    root.mkdir()
    files = sorted(specforge_set.root.glob("data_*"))
    for p in files[:40]:
        os.symlink(p, root / p.name)
    state = tmp_path / "s.jsonl"
    first = run_audit(Plan(root, str(specforge_set.spec), reference=f"hf:{tiny_target}", exact_files=0, state_path=state))
    assert len(first.profile.files) == 12
    gone = next(p for p in sorted(root.iterdir()) if str(p) not in first.profile.files)
    gone.unlink()
    for p in files[40:50]:
        os.symlink(p, root / p.name)
    again = run_audit(Plan(root, str(specforge_set.spec), reference=f"hf:{tiny_target}", exact_files=0, state_path=state,
                           resume=True))  # the prompts spread over 49 files are others: the state's are taken
    assert again.resumed == 39 and again.profile.files == first.profile.files


def test_resume_knows_the_files_through_a_symlink_or_dotdot(dump_set, tmp_path):
    state = tmp_path / "s.jsonl"
    run_audit(Plan(dump_set.root, str(dump_set.spec), state_path=state, structure_only=True))
    link = tmp_path / "link"
    link.symlink_to(dump_set.root, target_is_directory=True)
    for root in (link, dump_set.root / ".." / dump_set.root.name):
        again = run_audit(Plan(root, str(dump_set.spec), state_path=state, structure_only=True, resume=True))
        assert again.resumed == 60


def test_an_interrupted_pool_stops_its_workers_at_once(dump_set, monkeypatch):
    import multiprocessing

    import surgeon.audit.worker as worker
    from surgeon.audit.pipeline import LOCAL_BATCH, _local

    real = worker.audit_file
    paths = sorted(str(p) for p in dump_set.root.glob("dump_*"))
    first = set(paths[:LOCAL_BATCH])

    def slow_after_the_first(ctx, path):
        if path not in first:
            time.sleep(5)  # every batch after the first takes 20 s: waiting for them is what must not happen
        return real(ctx, path)

    monkeypatch.setattr(worker, "audit_file", slow_after_the_first)  # the forked workers have it too
    gen = _local(worker.Context(str(dump_set.spec)), paths, 2, {})
    next(gen)
    t = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        gen.throw(KeyboardInterrupt)
    assert time.monotonic() - t < 4
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not multiprocessing.active_children()


def test_a_resume_rebuilds_its_profile_on_its_own_files_or_says_which_are_gone(specforge_set, tiny_target, tmp_path):
    root = tmp_path / "set"
    root.mkdir()
    for p in sorted(specforge_set.root.glob("data_*"))[:30]:
        os.symlink(p, root / p.name)
    state = tmp_path / "s.jsonl"
    ref = f"hf:{tiny_target}"
    first = run_audit(Plan(root, str(specforge_set.spec), reference=ref, exact_files=0, state_path=state))
    moved = tmp_path / "moved"
    root.rename(moved)  # the state names the profile's files relative to DIR: a moved set resumes
    again = run_audit(Plan(moved, str(specforge_set.spec), reference=ref, exact_files=0, state_path=state, resume=True))
    assert again.profile.digest() == first.profile.digest()
    other = tmp_path / "other"
    other.mkdir()
    for p in sorted(specforge_set.root.glob("data_*"))[100:110]:
        os.symlink(p, other / p.name)
    with pytest.raises(BadInput, match=r"s\.jsonl:1:1: its profile was built on files no longer in DIR \(data_"):
        run_audit(Plan(other, str(specforge_set.spec), reference=ref, exact_files=0, state_path=state, resume=True))
    (moved / Path(first.profile.files[3]).name).unlink()
    with pytest.raises(BadInput, match=Path(first.profile.files[3]).name):
        run_audit(Plan(moved, str(specforge_set.spec), reference=ref, exact_files=0, state_path=state, resume=True))
