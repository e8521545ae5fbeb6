"""Benchmark: the audit's per-file time of this checkout against another commit's, alternated in the
same minutes (on a host shared with other jobs, figures from different minutes do not compare).

    .venv/bin/python benchmarks/audit_ab.py [--base REV] [--set DIR] [--rounds 6] [--json]

A worktree of ``--base`` (default ``HEAD~1``) is made in a temporary directory. Two long-lived child
processes, one per tree, each import their own ``surgeon``, build the ``hf:`` identity profile of
the synthetic set once (``benchmarks/audit.py``'s set: ``--set DIR`` reuses one made there), and then
on each request audit every file in one process (``surgeon.audit.worker.run_batch``, one torch
thread). Each round times the raw read of the files, then one pass of the base, then one of this
checkout. The baseline is named: ``--base``'s time a file; the ratio is base time / this time
(> 1: this checkout is faster), the median over rounds, with each side's ratio to the raw read.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

CHILD = r"""
import sys, time, glob
tree, setdir = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
import torch
torch.set_num_threads(1)
from surgeon.audit.reference import build_profile
from surgeon.audit.worker import Context, run_batch
from surgeon.core.spec import load_spec
paths = sorted(glob.glob(setdir + "/set/data_*"))
profile, _ = build_profile("hf:" + setdir + "/model", load_spec(setdir + "/spec.yaml"), paths, [])
ctx = Context(setdir + "/spec.yaml", profile=profile)
try:  # what a pool worker does before its first file, where the tree has it
    from surgeon.audit.heap import settle_owned
    settle_owned()
except ImportError:
    pass
run_batch(ctx, paths)  # warm
print("ready", flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    for i in range(0, len(paths), 4):
        run_batch(ctx, paths[i:i + 4])
    print((time.perf_counter() - t) / len(paths) * 1e3, flush=True)
"""


def _child(tree: Path, setdir: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(tree), str(setdir)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready", f"{tree}: the child did not start"
    return p


def _pass(p: subprocess.Popen) -> float:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("run\n")
    p.stdin.flush()
    return float(p.stdout.readline())


def run(args) -> dict:
    from audit import _median, _read_all, make_set

    tmp = Path(tempfile.mkdtemp(prefix="surgeon-audit-ab-"))
    setdir = Path(args.set) if args.set else tmp / "set"
    make_set(argparse.Namespace(files=48, hidden=2048, lengths="1024,1536,2048"), setdir)
    paths = sorted((setdir / "set").glob("data_*"))
    sha = subprocess.run(["git", "rev-parse", args.base], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    base = tmp / "base"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), sha], cwd=ROOT, check=True)
    kids = []
    try:
        kids = [_child(base, setdir), _child(ROOT, setdir)]
        rounds = []
        for _ in range(args.rounds):
            _read_all(paths)
            t = time.perf_counter()
            _read_all(paths)
            raw = (time.perf_counter() - t) / len(paths) * 1e3
            rounds.append({"raw_ms": raw, "base_ms": _pass(kids[0]), "this_ms": _pass(kids[1])})
    finally:
        for k in kids:
            k.kill()
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    return {"base": args.base, "base_sha": sha, "files": len(paths), "bytes": sum(p.stat().st_size for p in paths),
            "rounds": rounds, "ratio_base_vs_this": _median([r["base_ms"] / r["this_ms"] for r in rounds]),
            "base_vs_raw_read": _median([r["raw_ms"] / r["base_ms"] for r in rounds]),
            "this_vs_raw_read": _median([r["raw_ms"] / r["this_ms"] for r in rounds])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD~1", help="the commit to compare with (the baseline)")
    ap.add_argument("--set", help="make the synthetic set here once, and reuse it")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rep = run(args)
    if args.json:
        print(json.dumps(rep, indent=2))
        return
    for r in rep["rounds"]:
        print(f"raw {r['raw_ms']:.2f}  base {r['base_ms']:.2f}  this {r['this_ms']:.2f} ms a file")
    print(f"{rep['files']} files: this checkout {rep['ratio_base_vs_this']:.2f}x the speed of {rep['base']} "
          f"({rep['base_sha'][:7]}); to the raw read: base {rep['base_vs_raw_read']:.3f}x, "
          f"this {rep['this_vs_raw_read']:.3f}x (medians of {len(rep['rounds'])} rounds)")


if __name__ == "__main__":
    main()
