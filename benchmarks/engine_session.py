"""Benchmark: one engine handle per command (issue 33) against the baseline of locating the
engine and reading its source's signature again for each question, in one run, on the installed
engines with their probes already cached (so only the handle differs).

    .venv/bin/python benchmarks/engine_session.py [--json] [--repeat 5]

Runs ``lint`` of every spec in specs/ against both engines, and ``explain`` and ``render`` of each
spec, once as the command runs (inside one ``engine_session``) and once as the same command body
without a session (the baseline: what every command paid before). Prints seconds, ratios and how
many times each engine was located.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from surgeon import commands  # noqa: E402
from surgeon.engines import view  # noqa: E402

SPECS = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "specs").glob("*.yaml"))


def _workload(session: bool) -> None:
    def run(cmd, **kw):
        return (cmd if session else cmd.__wrapped__)(**kw)

    run(commands.lint, specs=SPECS, engines=["vllm", "sglang"])
    for spec in SPECS:
        run(commands.explain, spec=spec)
        for target in ("vllm", "sglang"):
            try:
                run(commands.render, spec=spec, target=target)
            except Exception:  # a spec a target refuses: the same refusal in both runs
                pass


def _measure(session: bool, repeat: int) -> tuple[float, int]:
    located = 0
    real = view.locate_engine

    def counting(engine, root=None):
        nonlocal located
        located += 1
        return real(engine, root)

    view.locate_engine = counting
    try:
        best = float("inf")
        for _ in range(repeat):
            located = 0
            t = time.perf_counter()
            _workload(session)
            best = min(best, time.perf_counter() - t)
        return best, located
    finally:
        view.locate_engine = real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    _workload(True)  # probe both engines once (the process cache), so both runs find them probed
    base_s, base_n = _measure(False, args.repeat)
    sess_s, sess_n = _measure(True, args.repeat)
    report = {"specs": len(SPECS), "repeat": args.repeat,
              "baseline": {"name": "no session: each question locates the engine again", "seconds": round(base_s, 3),
                           "located": base_n},
              "session": {"seconds": round(sess_s, 3), "located": sess_n},
              "speedup": round(base_s / sess_s, 2), "fewer_locates": round(base_n / max(1, sess_n), 1)}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"lint + explain + render of {len(SPECS)} specs, best of {args.repeat}:")
    print(f"  baseline (no session): {base_s:.3f} s, the engines located {base_n} times")
    print(f"  one handle per command: {sess_s:.3f} s, located {sess_n} times")
    print(f"  {report['speedup']}x faster, {report['fewer_locates']}x fewer locates")


if __name__ == "__main__":
    main()
