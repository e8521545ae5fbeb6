"""Benchmark: a full engine probe against the naive baseline of parsing every model file with
libcst (what a probe without a pre-filter would pay), in one run, on the installed engines.

    .venv/bin/python benchmarks/probe.py [--json]

Prints, per engine: baseline seconds (libcst parse of every model file), probe seconds (no cache),
cached probe seconds, and the ratios. With --json, one JSON object on stdout.
"""

from __future__ import annotations

import json
import sys
import time

import libcst

from surgeon.engines.probes.probe import locate_engine, probe_engine
from surgeon.engines.source.locate import layout_of


def _baseline(engine: str) -> tuple[float, int, int]:
    loc = locate_engine(engine)
    files = sorted(loc.models_dir.rglob("*.py"))
    lines = 0
    start = time.perf_counter()
    for f in files:
        text = f.read_text(encoding="utf-8")
        lines += text.count("\n")
        libcst.parse_module(text)
    return time.perf_counter() - start, len(files), lines


def main() -> None:
    report = {}
    for engine in ("sglang", "vllm"):
        layout_of(engine)
        base, nfiles, nlines = _baseline(engine)
        t = time.perf_counter()
        probe = probe_engine(engine, cache=False)
        cold = time.perf_counter() - t
        probe_engine(engine, cache=True)  # fill
        t = time.perf_counter()
        probe_engine(engine, cache=True)
        warm = time.perf_counter() - t
        cov = probe.coverage()
        report[engine] = {
            "version": probe.version, "model_files": nfiles, "lines": nlines,
            "baseline_parse_all_s": round(base, 3), "probe_s": round(cold, 3), "probe_cached_s": round(warm, 3),
            "speedup_vs_parse_all": round(base / cold, 2), "cached_speedup": round(cold / warm, 1),
            "coverage": cov,
        }
    if "--json" in sys.argv:
        print(json.dumps(report, indent=2))
        return
    for engine, r in report.items():
        print(f"{engine} {r['version']}: {r['model_files']} files, {r['lines']} lines")
        print(f"  baseline (libcst parse of every model file): {r['baseline_parse_all_s']:.2f} s")
        print(f"  probe (pre-filter + libcst where needed):    {r['probe_s']:.2f} s  ({r['speedup_vs_parse_all']}x faster)")
        print(f"  probe from cache:                            {r['probe_cached_s']:.3f} s  "
              f"({r['cached_speedup']}x faster than cold)")


if __name__ == "__main__":
    main()
