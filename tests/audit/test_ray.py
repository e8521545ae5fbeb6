"""`surgeon audit --ray`: the same pipeline as Ray tasks on a local Ray head (loopback, two worker
CPUs) gives the local run's answer, file for file. ``ray`` is imported normally: CI installs the
``[ray]`` extra and this test must run there, never skip."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray

from surgeon.audit.pipeline import Plan, run_audit
from surgeon.commands.outputs import json_output

REPO = Path(__file__).resolve().parents[2]
TIMING = ("seconds", "files_per_s", "mb_per_s", "resumed", "workers", "backend")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    """A Ray head on 127.0.0.1 with 2 CPUs, in its own process group, stopped by that group's id."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="/tmp/sa-ray")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())", "start", "--head",
         "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
         f"--temp-dir={temp}", "--block", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                ray.init(address=address, log_to_driver=False, logging_level="ERROR")
                ray.shutdown()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(1)
        yield address
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.mark.slow
def test_ray_gives_the_local_answer(ray_head, dump_set, reference_file, tmp_path):
    local = run_audit(Plan(dump_set.root, str(dump_set.spec), reference=str(reference_file),
                           state_path=tmp_path / "local.jsonl"))
    on_ray = run_audit(Plan(dump_set.root, str(dump_set.spec), reference=str(reference_file), ray_address=ray_head,
                            workers=2, state_path=tmp_path / "ray.jsonl"))
    assert on_ray.backend == f"ray:{ray_head}"
    assert {k: v for k, v in json_output("audit", on_ray).items() if k not in TIMING} == \
        {k: v for k, v in json_output("audit", local).items() if k not in TIMING}
    assert json_output("audit", on_ray)["flagged"] >= 3
