"""Benchmark: `surgeon audit` throughput against the raw read rate of the same files, one vs two
workers, memory vs the number of files, and the structure pass on 100k files, in one run.

    .venv/bin/python benchmarks/audit.py [--json] [--files 400] [--hidden 1024] [--lengths 512,768,1024]
                                         [--structure-files 100000]

(1) A synthetic SpecForge set (surgeon.audit.synthetic: a tiny 8-layer Llama of ``--hidden``,
    ``--files`` samples of ``--lengths`` tokens in bf16, seeded faults) in a temporary directory. The raw
    sequential read rate: every file read whole with ``readinto``, in path order, page cache warm
    (second pass). The audit (structure, values, identity against an ``hf:`` profile; the profile's
    build is outside the timed loop, no exact identification) with 1 and 2 local workers.
    Targets: audit >= 50% of the raw read rate; 2 workers >= 1.6x one.
(2) Memory: the peak RSS of a child process auditing the first quarter of the files and all of
    them (flat: the tensors of one file at a time per worker).
(3) The structure pass (``--structure-only``: headers only) over ``--structure-files`` tiny
    speculators files.

The CPU is shared with whatever else runs: figures move with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def raw_read_rate(paths: list[Path]) -> tuple[float, int]:
    """(bytes/s, bytes) of reading every file whole, in order; the second of two passes (warm)."""
    buf = bytearray(1 << 24)
    total, dt = 0, 0.0
    for _ in range(2):
        total, t = 0, time.perf_counter()
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
        dt = time.perf_counter() - t
    return total / dt, total


def audit_rate(root: Path, spec: Path, reference: str, workers: int, state: Path) -> dict:
    from surgeon.audit.pipeline import Plan, run_audit

    rep = run_audit(Plan(root, str(spec), reference=reference, workers=workers, exact_files=0, state_path=state))
    j = rep.to_json()
    return {"seconds": j["seconds"], "files_per_s": j["files_per_s"], "bytes_per_s": rep.bytes / rep.seconds,
            "flagged": j["flagged"]}


def child_peak(root: Path, spec: Path, state: Path) -> int:
    out = subprocess.run([sys.executable, __file__, "--child", str(root), str(spec), str(state)], check=True,
                         capture_output=True, text=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1])["maxrss_kb"])


def subset(root: Path, n: int, dest: Path) -> Path:
    dest.mkdir()
    for p in sorted(root.iterdir())[:n]:
        if not p.name.startswith("."):
            os.symlink(p, dest / p.name)
    return dest


def structure_set(dest: Path, n: int) -> Path:
    """``n`` tiny speculators files (the same bytes: the structure pass reads only headers)."""
    import torch
    from safetensors.torch import save

    blob = save({"token_ids": torch.arange(16), "hidden_states": torch.zeros(16, 4, 64, dtype=torch.bfloat16)})
    dest.mkdir()
    for i in range(n):
        sub = dest / f"{i // 1000:03d}"
        if i % 1000 == 0:
            sub.mkdir()
        (sub / f"hs_{i}.safetensors").write_bytes(blob)
    return dest


def run(args) -> dict:
    from surgeon.audit.synthetic import make_synthetic_set
    from surgeon.audit.synthetic import spec_text as _spec_text
    from surgeon.run.tinymodels import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="surgeon-audit-bench-"))
    rep: dict = {"files": args.files, "hidden": args.hidden, "lengths": args.lengths, "cpus": os.cpu_count()}
    model = make_tiny_model("llama", tmp / "model", num_layers=8, hidden_size=args.hidden, seed=0, residual_scale=4.0)
    t = time.perf_counter()
    lengths = tuple(int(x) for x in args.lengths.split(","))
    synth = make_synthetic_set(tmp, model, files=args.files, layout="specforge", count=2, lengths=lengths)
    rep["generate_s"] = time.perf_counter() - t
    paths = sorted(synth.root.glob("data_*"))
    rate, total = raw_read_rate(paths)
    rep["raw_read"] = {"bytes": total, "bytes_per_s": rate}
    ref = f"hf:{model}"
    one = audit_rate(synth.root, synth.spec, ref, 1, tmp / "s1.jsonl")
    two = audit_rate(synth.root, synth.spec, ref, 2, tmp / "s2.jsonl")
    rep["audit_1_worker"], rep["audit_2_workers"] = one, two
    rep["ratio_audit_vs_raw_read"] = one["bytes_per_s"] / rate
    rep["ratio_2_vs_1_workers"] = two["bytes_per_s"] / one["bytes_per_s"]
    quarter = subset(synth.root, len(paths) // 4, tmp / "quarter")
    rep["memory"] = {"files": [len(paths) // 4, len(paths)],
                     "maxrss_kb": [child_peak(quarter, synth.spec, tmp / "m1.jsonl"),
                                   child_peak(synth.root, synth.spec, tmp / "m2.jsonl")]}
    if args.structure_files:
        t = time.perf_counter()
        sroot = structure_set(tmp / "structure", args.structure_files)
        rep["structure_generate_s"] = time.perf_counter() - t
        sspec = tmp / "structure.yaml"
        sspec.write_text(_spec_text("speculators", 8, 64))
        from surgeon.audit.pipeline import Plan, run_audit

        r = run_audit(Plan(sroot, str(sspec), structure_only=True, state_path=tmp / "s3.jsonl"))
        rep["structure_pass"] = {"files": r.files, "seconds": r.seconds, "files_per_s": r.files / r.seconds,
                                 "flagged": r.agg.flagged}
    if not args.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return rep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--files", type=int, default=400)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--lengths", default="512,768,1024", help="sample lengths in tokens, comma-separated")
    ap.add_argument("--structure-files", type=int, default=100_000)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        from surgeon.audit.pipeline import Plan, run_audit

        root, spec, state = args.child
        run_audit(Plan(Path(root), spec, state_path=Path(state)))
        # VmHWM: this process's own peak (ru_maxrss keeps the forking parent's peak across exec)
        hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                   if line.startswith("VmHWM:"))
        print(json.dumps({"maxrss_kb": hwm}))
        return
    rep = run(args)
    if args.json:
        print(json.dumps(rep, indent=2))
        return
    mb = 1e6
    print(f"raw sequential read (warm): {rep['raw_read']['bytes_per_s'] / mb:.0f} MB/s over {rep['files']} files "
          f"({rep['raw_read']['bytes'] / mb:.0f} MB)")
    for k in ("audit_1_worker", "audit_2_workers"):
        a = rep[k]
        print(f"{k}: {a['bytes_per_s'] / mb:.1f} MB/s, {a['files_per_s']} files/s, {a['flagged']} files flagged")
    print(f"audit / raw read: {rep['ratio_audit_vs_raw_read']:.3f}x (target >= 0.5x)")
    print(f"2 workers / 1: {rep['ratio_2_vs_1_workers']:.2f}x (target >= 1.6x)")
    m = rep["memory"]
    print(f"peak RSS: {m['maxrss_kb'][0] / 1024:.0f} MB at {m['files'][0]} files, {m['maxrss_kb'][1] / 1024:.0f} MB at "
          f"{m['files'][1]} files")
    if "structure_pass" in rep:
        s = rep["structure_pass"]
        print(f"structure pass: {s['files']} files in {s['seconds']:.1f} s ({s['files_per_s']:.0f} files/s), "
              f"{s['flagged']} flagged")


if __name__ == "__main__":
    main()
