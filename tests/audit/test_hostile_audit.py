"""The audit under hostile and careless conditions (issue 36, items 1 and 4), on real files, links,
FIFOs and hard links in tmp_path: its state file and ``--report`` never follow a link, never wait on
a FIFO, never overwrite a file that is not theirs (a victim outside the set keeps its bytes); a FIFO
or another file swapped in at a data file's path after the gate is refused, never waited on or read;
a zip bomb is refused before it is inflated; ``--workers`` never starts more processes than cores;
the pool's workers die with a driver killed with SIGKILL; Ray's own lines never reach stdout.

Every run that would hang on a regression runs in a subprocess with a timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from surgeon.audit.pipeline import Plan, run_audit, usable_cores
from surgeon.audit.structure import STATE_NAME
from surgeon.audit.synthetic import spec_text
from surgeon.audit.worker import Context, audit_file
from surgeon.cli import main

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
H, T = 16, 6


def _spec(tmp_path: Path, layout: str = "speculators") -> Path:
    p = tmp_path / f"spec_{layout}.yaml"
    p.write_text(spec_text(layout, 8, H))
    return p


def _slots(seed: int = 0, n: int = T) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, generator=g) * (i + 1) for i in range(4)]


def _speculators(path: Path, seed: int = 0) -> Path:
    save_file({"token_ids": torch.arange(T), "hidden_states": torch.stack(_slots(seed), 1).contiguous()}, str(path))
    return path


def _specforge(path: Path, seed: int = 0, legacy: bool = False) -> Path:
    s = _slots(seed)
    torch.save({"input_ids": torch.arange(T)[None], "loss_mask": torch.ones(1, T),
                "aux_hidden_state": torch.cat(s[:-1], -1)[None], "hidden_state": s[-1][None]}, path,
               _use_new_zipfile_serialization=not legacy)
    return path


def _rezip(src: Path, dst: Path, compression: int) -> Path:
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w", compression) as w:
        for info in z.infolist():
            w.writestr(info.filename, z.read(info.filename))
    return dst


def _set(tmp_path: Path, files: int = 3) -> tuple[Path, Path]:
    root = tmp_path / "set"
    root.mkdir()
    for i in range(files):
        _speculators(root / f"hs_{i}.safetensors", seed=i)
    return root, _spec(tmp_path)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the set, which no audit may change."""
    v = tmp_path / "victim.txt"
    v.write_text("precious\n")
    return v


def _cli(*args, code: int):
    r = CliRunner().invoke(main, ["audit", *map(str, args)])
    assert "Traceback" not in r.output and not isinstance(r.exception, AssertionError), r.output
    assert r.exit_code == code, (r.exit_code, r.output)
    return r


def _one_line(text: str, *needles: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("surgeon: ") and "Traceback" not in text, text
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


def _subprocess_cli(*args, timeout: int = 120) -> subprocess.CompletedProcess:
    """``surgeon audit ARGS`` in a subprocess: a regression that hangs fails here, in ``timeout`` s."""
    return subprocess.run([sys.executable, "-m", "surgeon", "audit", *map(str, args)], env=ENV, capture_output=True,
                          text=True, timeout=timeout)


# -- the state file ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("resume", [False, True])
def test_a_state_shipped_in_the_set_as_a_link_is_refused_not_written_through(tmp_path, victim, resume):
    root, spec = _set(tmp_path)
    (root / STATE_NAME).symlink_to(victim)
    r = _cli(root, "--spec", spec, "--structure-only", *(["--resume"] if resume else []), code=2)
    _one_line(r.output, str(root / STATE_NAME), "symbolic link")
    assert victim.read_text() == "precious\n" and (root / STATE_NAME).is_symlink()


def test_an_explicit_state_link_is_refused_and_a_dangling_one_creates_nothing(tmp_path, victim):
    root, spec = _set(tmp_path)
    link = tmp_path / "s.jsonl"
    link.symlink_to(victim)
    _one_line(_cli(root, "--spec", spec, "--structure-only", "--state", link, code=2).output, str(link), "link")
    assert victim.read_text() == "precious\n"
    dangling = tmp_path / "d.jsonl"
    dangling.symlink_to(tmp_path / "created-through-the-link")
    _one_line(_cli(root, "--spec", spec, "--structure-only", "--state", dangling, code=2).output, str(dangling))
    assert not (tmp_path / "created-through-the-link").exists()


def test_a_state_path_holding_a_file_that_is_not_a_state_is_not_overwritten(tmp_path, victim):
    root, spec = _set(tmp_path)
    _one_line(_cli(root, "--spec", spec, "--structure-only", "--state", victim, code=2).output,
              str(victim), "not an audit state")
    assert victim.read_text() == "precious\n"
    state = tmp_path / "s.jsonl"  # a state of an earlier run is the audit's own: replaced
    _cli(root, "--spec", spec, "--structure-only", "--state", state, code=0)
    _cli(root, "--spec", spec, "--structure-only", "--state", state, code=0)
    assert len(state.read_text().splitlines()) == 4


def test_a_resume_refuses_a_state_hard_linked_to_another_file(tmp_path):
    root, spec = _set(tmp_path)
    state = tmp_path / "s.jsonl"
    _cli(root, "--spec", spec, "--structure-only", "--state", state, code=0)
    with state.open("ab") as f:
        f.write(b'{"half a record')  # a killed run's last line: a resume would cut it, in place
    other = tmp_path / "elsewhere.jsonl"
    os.link(state, other)
    before = other.read_bytes()
    _one_line(_cli(root, "--spec", spec, "--structure-only", "--state", state, "--resume", code=2).output,
              str(state), "hard links")
    assert other.read_bytes() == before


def test_a_fifo_as_the_state_or_the_report_is_refused_without_waiting(tmp_path):
    root, spec = _set(tmp_path)
    os.mkfifo(root / STATE_NAME)
    for extra in ([], ["--resume"]):
        r = _subprocess_cli(root, "--spec", spec, "--structure-only", *extra)
        assert r.returncode == 2, r.stderr
        _one_line(r.stderr, str(root / STATE_NAME), "FIFO")
    fifo = tmp_path / "r.html"
    os.mkfifo(fifo)
    r = _subprocess_cli(root, "--spec", spec, "--structure-only", "--state", tmp_path / "s.jsonl", "--report", fifo)
    assert r.returncode == 2, r.stderr
    _one_line(r.stderr, f"--report {fifo}", "FIFO")


# -- the report -------------------------------------------------------------------------------------------------------
def test_the_report_never_follows_a_link_nor_overwrites_a_file(tmp_path, victim):
    pytest.importorskip("matplotlib")
    root, spec = _set(tmp_path)
    link = tmp_path / "r.html"
    link.symlink_to(victim)
    _one_line(_cli(root, "--spec", spec, "--structure-only", "--report", link, code=2).output,
              f"--report {link}", "symbolic link")
    _one_line(_cli(root, "--spec", spec, "--structure-only", "--report", victim, code=2).output,
              f"--report {victim}", "refusing to overwrite")
    assert victim.read_text() == "precious\n" and link.is_symlink()


def test_a_report_file_made_during_the_audit_is_not_overwritten(tmp_path, victim):
    pytest.importorskip("matplotlib")
    from surgeon.audit.html import write_report
    from surgeon.core.errors import BadInput

    root, spec = _set(tmp_path)
    rep = run_audit(Plan(root, str(spec), structure_only=True, state_path=tmp_path / "s.jsonl"))
    page = tmp_path / "r.html"
    page.symlink_to(victim)  # made after the check before the audit: the write checks again
    with pytest.raises(BadInput, match="symbolic link"):
        write_report(rep, page)
    assert victim.read_text() == "precious\n"
    write_report(rep, tmp_path / "fresh.html")
    assert "surgeon audit" in (tmp_path / "fresh.html").read_text()


# -- data files swapped after the gate ---------------------------------------------------------------------------------
_SWAP = textwrap.dedent("""
    import json, os, sys
    import surgeon.audit.structure as S
    import surgeon.audit.worker as W
    from surgeon.audit.worker import Context, audit_file

    spec, cases = sys.argv[1], json.loads(sys.argv[2])

    def swap(path, how):
        tmp = str(path) + ".new"
        if how == "fifo":
            os.mkfifo(tmp)
        else:  # another regular file, the same bytes: still not the file the gate read
            with open(path, "rb") as src, open(tmp, "wb") as dst:
                dst.write(src.read())
        os.replace(tmp, path)

    real_gate, real_structure = S.open_tensor_file, W.read_structure
    out = {}
    for path, when, how in cases:
        def gate(p, **kw):
            g = real_gate(p, **kw)
            if when == "gate":
                swap(p, how)
            return g

        def structure(p):
            st = real_structure(p)
            if when == "structure":
                swap(p, how)
            return st

        S.open_tensor_file, W.read_structure = gate, structure
        out[f"{os.path.basename(path)} {when} {how}"] = audit_file(Context(spec), path)["findings"]
    print(json.dumps(out))
""")


def test_a_fifo_or_another_file_swapped_in_after_the_gate_is_refused_never_waited_on(tmp_path):
    """Each reader that opens a data file after the gate (the row reader, torch's zip reader,
    ``torch.load`` of a compressed or legacy file) opens the very file the gate read: a FIFO
    swapped in is a finding at once (no hang), another file is one too (no answer about bytes the
    header did not describe)."""
    spec = _spec(tmp_path)
    makers = {"hs.safetensors": _speculators, "stored.ckpt": _specforge,
              "legacy.pt": lambda p: _specforge(p, legacy=True),
              "deflated.ckpt": lambda p: _rezip(_specforge(p.with_suffix(".src")), p, zipfile.ZIP_DEFLATED)}
    # after the gate: every format; after the structure: the formats read again for their values
    plan = [(name, "gate", how) for name in makers for how in ("fifo", "file")]
    plan += [(name, "structure", how) for name in ("hs.safetensors", "stored.ckpt", "deflated.ckpt")
             for how in ("fifo", "file")]
    cases = []
    for i, (name, when, how) in enumerate(plan):
        folder = tmp_path / f"c{i}"
        folder.mkdir()
        makers[name](folder / name)
        cases.append((str(folder / name), when, how))
    spec_path = str(_spec(tmp_path, "specforge"))
    r = subprocess.run([sys.executable, "-c", _SWAP, spec_path, json.dumps(cases)], env=ENV, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(got) == len(cases) and spec
    for key, findings in got.items():
        unreadable = [f["detail"] for f in findings if f["kind"] == "unreadable"]
        want = "FIFO" if key.endswith("fifo") else "replaced by another file"
        assert len(unreadable) == 1 and want in unreadable[0], (key, findings)
        assert not any(f["kind"] == "error" for f in findings), (key, findings)


# -- a zip bomb --------------------------------------------------------------------------------------------------------
def test_a_zip_bomb_is_refused_before_it_is_inflated(tmp_path, monkeypatch):
    src = tmp_path / "zeros.src"
    torch.save({"input_ids": torch.arange(2048)[None], "loss_mask": torch.ones(1, 2048),
                "aux_hidden_state": torch.zeros(1, 2048, 3 * 2048, dtype=torch.bfloat16),
                "hidden_state": torch.zeros(1, 2048, 2048, dtype=torch.bfloat16)}, src)
    bomb = _rezip(src, tmp_path / "data_0.ckpt", zipfile.ZIP_DEFLATED)
    assert bomb.stat().st_size * 100 < src.stat().st_size  # 33 MB inflated from well under 330 KB

    inflated: list[str] = []
    real = torch.load

    def spy(*args, **kwargs):  # nothing may inflate it: torch.load would read every record whole
        inflated.append(str(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    out = audit_file(Context(str(_spec(tmp_path, "specforge"))), str(bomb))
    details = [f["detail"] for f in out["findings"] if f["kind"] == "unreadable"]
    assert len(details) == 1 and "zip bomb" in details[0] and str(bomb) in details[0], out["findings"]
    assert not inflated
    # a compressed sample of ordinary values is read as before (deflate gains little on them)
    ok = _rezip(_specforge(tmp_path / "plain.src"), tmp_path / "data_1.ckpt", zipfile.ZIP_DEFLATED)
    out = audit_file(Context(str(_spec(tmp_path, "specforge"))), str(ok))
    assert not [f for f in out["findings"] if f["kind"] in ("unreadable", "error")], out["findings"]


def test_a_stored_zip_entry_that_declares_more_bytes_than_it_holds_is_refused(tmp_path):
    from surgeon.capture.tensorfiles import open_tensor_file
    from surgeon.core.errors import BadInput

    path = _specforge(tmp_path / "data_0.ckpt")
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename)
    # that entry's uncompressed size in the central directory (what readers allocate), forged to 1 GB
    cd = raw.index(b"PK\x01\x02")
    while raw[cd + 46:cd + 46 + int.from_bytes(raw[cd + 28:cd + 30], "little")].decode() != info.filename:
        cd = raw.index(b"PK\x01\x02", cd + 4)
    raw[cd + 24:cd + 28] = (1 << 30).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(BadInput, match="declares"):
        open_tensor_file(path)


# -- the processes -----------------------------------------------------------------------------------------------------
def test_workers_are_capped_at_the_usable_cores_with_a_note(tmp_path, monkeypatch):
    import concurrent.futures

    root, spec = _set(tmp_path, files=6)
    cores = usable_cores()
    started: list[int] = []
    real = concurrent.futures.ProcessPoolExecutor

    class Capped(real):  # type: ignore[misc,valid-type]
        def __init__(self, max_workers=None, *args, **kwargs):
            started.append(max_workers)
            assert max_workers <= cores, f"a pool of {max_workers} processes on {cores} cores"
            super().__init__(max_workers, *args, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Capped)
    r = _cli(root, "--spec", spec, "--structure-only", "--workers", "1000000", "--state", tmp_path / "s.jsonl",
             "--json", code=0)
    data = json.loads(r.stdout)
    assert data["workers"] == cores and started == ([cores] if cores > 1 else [])
    assert any(n.startswith("--workers 1000000: ") for n in data["notes"]), data["notes"]


_KILLED = textwrap.dedent("""
    import sys, time
    import surgeon.audit.worker as W
    from pathlib import Path
    from surgeon.audit.pipeline import Plan, run_audit

    real = W.audit_file

    def slow(ctx, path):  # the forked workers have it too: the run stays mid-way for minutes
        time.sleep(2)
        return real(ctx, path)

    W.audit_file = slow
    run_audit(Plan(Path(sys.argv[1]), sys.argv[2], workers=2, structure_only=True, state_path=Path(sys.argv[3])))
""")


def _alive(psutil, proc) -> bool:
    """Whether ``proc`` still runs (a zombie, dead and not yet reaped, does not)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_pool_workers_die_with_a_driver_killed_with_sigkill(tmp_path):
    psutil = pytest.importorskip("psutil")
    if usable_cores() < 2:
        pytest.skip("one usable core: the audit starts no pool")
    root, spec = _set(tmp_path, files=40)
    p = subprocess.Popen([sys.executable, "-c", _KILLED, str(root), str(spec), str(tmp_path / "s.jsonl")], env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    workers: list = []
    try:
        driver = psutil.Process(p.pid)
        deadline = time.monotonic() + 90
        while len(workers) < 2 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
            workers = [c for c in driver.children() if _alive(psutil, c)]
        assert len(workers) == 2, p.stderr.read().decode()[-2000:] if p.poll() is not None else workers
        time.sleep(1)  # the workers at work on their first batch
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        gone_by = time.monotonic() + 10
        alive = workers
        while alive and time.monotonic() < gone_by:
            time.sleep(0.1)
            alive = [w for w in alive if _alive(psutil, w)]
        assert not alive, f"workers {[w.pid for w in alive]} outlived their driver"
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        for w in workers:  # on a failure, what this test started is ended all the same
            if w.is_running():
                w.kill()


def test_a_worker_whose_driver_is_gone_before_it_starts_exits(tmp_path):
    """The parent-death signal is armed after the fork: a driver gone before that sends none, so
    the worker checks its parent itself."""
    code = textwrap.dedent("""
        import os, sys
        from surgeon.audit.worker import die_with
        die_with(int(sys.argv[1]))  # not this process's parent: as if the driver were gone already
        print("lived on")
    """)
    r = subprocess.run([sys.executable, "-c", code, str(os.getpid() + 10**6)], env=ENV, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and not r.stdout and not r.stderr, (r.returncode, r.stdout, r.stderr)


# -- Ray ---------------------------------------------------------------------------------------------------------------
def test_ray_prints_go_to_stderr_not_stdout(tmp_path):
    """What Ray's driver prints while the audit runs on it (from its error-listener thread, to
    ``sys.stdout``; its core, to file descriptor 1) lands on stderr: ``--json`` keeps stdout."""
    pytest.importorskip("ray")
    # what Ray's error listener does when it hears a worker died: its own print_to_stdstream, from its thread
    code = textwrap.dedent("""
        import os, sys, threading
        from ray._private.worker import print_to_stdstream
        from surgeon.audit.ray_backend import stdout_to_stderr
        heard = {"lines": ["A worker died or was killed while executing a task"], "pid": "raylet", "is_err": False}
        with stdout_to_stderr():
            t = threading.Thread(target=print_to_stdstream, args=(heard,), kwargs={"ignore_prefix": False})
            t.start(); t.join()
            os.write(1, b"core worker line\\n")
        print('{"json": true}')
    """)
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"json": True}, r.stdout
    assert "worker died" in r.stderr and "core worker line" in r.stderr
