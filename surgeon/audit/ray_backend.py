"""The audit on a Ray cluster: the same :func:`surgeon.audit.worker.run_batch` as Ray tasks.

The driver connects to ``address`` (a running cluster: ``ray start --head`` on the first machine,
``ray start --address ...`` on the others, each with surgeon importable), submits batches of
files as tasks with a bounded window in flight (``4 x`` the cluster's CPUs, at least ``workers``)
and takes the results back in submission order, so the answer is the local run's, file for file.
Every machine must see the files under the same path (a shared filesystem). ``ray`` is the
``[ray]`` extra: without it ``--ray`` is bad input naming the extra.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections import deque
from collections.abc import Iterator
from typing import Any

from surgeon.audit.worker import BATCH, Context, batches, run_batch_owned
from surgeon.core.errors import BadInput


def check_address(address: str) -> None:
    """Bad input unless something listens at ``address`` (``HOST:PORT`` or ``ray://HOST:PORT``;
    ``auto``, ``local`` and ``anyscale://`` are Ray's to resolve): asked before any work, where
    ``ray.init`` would wait on a dead address."""
    import socket

    if address in ("auto", "local") or address.startswith("anyscale://"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")  # a Ray Client address: its server's port
    if not sep or not port.isdigit():
        raise BadInput(f"--ray {address}: not HOST:PORT (or ray://HOST:PORT, auto, local)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as e:
        raise BadInput(f"--ray {address}: cannot connect to a Ray cluster there ({e.strerror or e})") from None


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Everything written to stdout in the block goes to stderr instead: Python's ``sys.stdout``
    (Ray's driver prints the errors it hears of, "A worker died or was killed...", there, from a
    thread, whatever ``log_to_driver`` says) and file descriptor 1 (its C++ core's writes), so
    ``--json`` keeps stdout for the JSON alone. Both restored when the block ends."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_on_ray(address: str, ctx: Context, todo: list[str], workers: int) -> Iterator[dict[str, Any]]:
    with stdout_to_stderr():  # for Ray's whole session: its error listener and log threads end at shutdown
        yield from _on_ray(address, ctx, todo, workers)


def _on_ray(address: str, ctx: Context, todo: list[str], workers: int) -> Iterator[dict[str, Any]]:
    import ray

    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR, include_dashboard=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise BadInput(f"--ray {address}: cannot connect to a Ray cluster there ({str(e).splitlines()[0][:160]})") from None
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        task = ray.remote(num_cpus=1, max_retries=2)(run_batch_owned)
        shared = ray.put(ctx)
        window: deque = deque()
        for batch in batches(todo, BATCH):
            window.append(task.remote(shared, batch))
            if len(window) >= 4 * max(workers, cpus):
                yield from ray.get(window.popleft())
        while window:
            yield from ray.get(window.popleft())
    finally:
        ray.shutdown()
