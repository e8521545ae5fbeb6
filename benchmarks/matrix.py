"""Benchmark: `surgeon conventions` and `surgeon coverage`, cold, on every engine release of the
matrix (the installed engines and the releases scripts/fetch-engines unpacks into .engines/), each
next to the naive baseline measured in the same run: a libcst parse of every file in the release's
model trees, in one process (what reading the source without a pre-filter would cost).

    .venv/bin/python benchmarks/matrix.py [--json]

The commands run as a user runs them: the installed CLI in a subprocess, from outside the checkout,
with SURGEON_NO_CACHE=1 (no probe cache) and the default of two processes. Issue 12's target: under
10 s each on this 2-core machine. The baseline ratio says how far a figure would move on a slower
or busier machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import libcst

from surgeon.engines.source.locate import locate_engine

REPO = Path(__file__).resolve().parent.parent
CLI = Path(sys.executable).parent / "surgeon"


def _releases() -> list[tuple[str, str, Path | None]]:
    rows: list[tuple[str, str, Path | None]] = [("vllm", "installed", None), ("sglang", "installed", None)]
    for line in (REPO / "scripts" / "engine-releases.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            dist, version = line.split()
            engine = dist.split("-")[0]
            rows.append((engine, version, REPO / ".engines" / f"{dist}-{version}" / engine))
    return rows


def _baseline(engine: str, root: Path | None) -> tuple[float, int, int]:
    loc = locate_engine(engine, root)
    files = sorted({f for d in loc.models_dirs for f in (loc.root / d).rglob("*.py")})
    lines = 0
    start = time.perf_counter()
    for f in files:
        text = f.read_text(encoding="utf-8")
        lines += text.count("\n")
        libcst.parse_module(text)
    return time.perf_counter() - start, len(files), lines


def _cold(verb: str, engine: str, root: Path | None) -> float:
    cmd = [str(CLI), verb, "--engine", engine, *(["--engine-root", str(root)] if root else [])]
    env = {**os.environ, "SURGEON_NO_CACHE": "1"}
    with tempfile.TemporaryDirectory() as cwd:  # outside the checkout: the installed package answers
        start = time.perf_counter()
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        took = time.perf_counter() - start
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()[-400:]}")
    return took


def main() -> None:
    out: dict[str, dict] = {}
    for engine, label, root in _releases():
        if root is not None and not root.is_dir():
            raise SystemExit(f"{root} is missing: run ./scripts/setup")
        version = locate_engine(engine, root).version
        conv, cov = _cold("conventions", engine, root), _cold("coverage", engine, root)
        base, nfiles, nlines = _baseline(engine, root)
        out[f"{engine} {version}" + (" (installed)" if root is None else "")] = {
            "files": nfiles, "lines": nlines, "conventions_s": round(conv, 3), "coverage_s": round(cov, 3),
            "baseline_parse_all_s": round(base, 3), "conventions_speedup": round(base / conv, 2),
            "coverage_speedup": round(base / cov, 2), "target_s": 10, "label": label,
        }
        print(f"{engine} {version}: conventions {conv:.2f} s, coverage {cov:.2f} s, "
              f"libcst parse of {nfiles} files {base:.1f} s", file=sys.stderr, flush=True)
    print(json.dumps(out) if "--json" in sys.argv else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
