"""Run every benchmark and write one Markdown table: each figure, its baseline, the ratio, the
target, and the command that reproduces it.

    .venv/bin/python benchmarks/report.py [--only NAME ...] [--output benchmarks/REPORT.md]

Each benchmark runs in its own process with ``--json`` (so one cannot skew another's memory or
threads); its raw JSON is kept next to the report (``benchmarks/results/NAME.json``). A benchmark
that fails is reported as failed in the table, with the tail of its stderr; the others still run.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

Row = tuple[str, str, str, str, str]  # figure, measured, baseline, ratio, target


def _ms(x: float) -> str:
    return f"{x:.2f} ms"


def _s(x: float) -> str:
    return f"{x:.3f} s" if x < 10 else f"{x:.1f} s"


def rows_probe(r: dict) -> list[Row]:
    out = []
    for engine, e in r.items():
        out.append((f"probe {engine} {e['version']} ({e['model_files']} files, {e['lines']} lines)",
                    _s(e["probe_s"]), f"libcst parse of every model file {_s(e['baseline_parse_all_s'])}",
                    f"{e['speedup_vs_parse_all']}x faster", "faster than parsing all"))
        out.append((f"probe {engine}, cached", _s(e["probe_cached_s"]), f"cold probe {_s(e['probe_s'])}",
                    f"{e['cached_speedup']}x faster", ""))
    return out


def rows_identify(r: dict) -> list[Row]:
    i, s = r["identify"], r["streaming"]
    return [
        ("identify, Kimi-size dump vs fingerprint reference", _s(min(i["fingerprint_s"])),
         f"exhaustive exact comparison {_s(i['baseline_exhaustive_exact_s_extrapolated'])}",
         f"{round(i['baseline_exhaustive_exact_s_extrapolated'] / min(i['fingerprint_s']), 1)}x faster",
         f"< {i['budget_s']} s" + ("" if i["fingerprint_correct"] else " (WRONG ANSWER)")),
        ("identify, Kimi-size dump vs full memory-mapped reference", _s(i["full_reference_first_s"]),
         f"exhaustive exact comparison {_s(i['baseline_exhaustive_exact_s_extrapolated'])}",
         f"{i['speedup_vs_exhaustive']}x faster",
         f"< {i['budget_s']} s" + ("" if i["full_reference_correct"] else " (WRONG ANSWER)")),
        ("fingerprint_file streaming rate", f"{s['fingerprint_file_gb_s']} GB/s",
         f"raw read of the same file {s['raw_read_gb_s']} GB/s", f"{s['ratio_vs_raw_read']}x",
         f">= {s['target_ratio']}x"),
    ]


def rows_hooks(r: dict) -> list[Row]:
    return [(f"{r['mode']} hooks, {r['layers']} x hidden {r['hidden']}, {x['tokens']} tokens/step",
             _ms(x["hooked_ms"]), f"unhooked forward {_ms(x['unhooked_ms'])}", f"{x['overhead'] * 100:+.2f}%",
             f"<= {r['target_overhead'] * 100:.0f}%") for x in r["results"]]


def rows_dumps(r: dict) -> list[Row]:
    t = r["tokens_per_s"]
    what = f"dump mode + async writer, {r['layers']} x hidden {r['hidden']}, {r['tokens_per_step']} tokens/step"
    return [
        (what, f"{t['dump']:.0f} tok/s", f"sync torch.save in forward {t['sync_torch_save']:.0f} tok/s",
         f"{r['dump_vs_sync_torch_save']}x", ">= 3x"),
        (what, f"{t['dump']:.0f} tok/s", f"unhooked {t['unhooked']:.0f} tok/s", f"{r['dump_vs_unhooked']}x", ">= 0.90x"),
    ]


def rows_apply(r: dict) -> list[Row]:
    out = [(f"apply + revert, {f['engine']} {f['file']} ({f['lines']} lines), spec {f['spec']}", _s(f["apply_revert_s"]),
            f"libcst parse of the file {_s(f['libcst_parse_s'])}", f"{f['ratio_to_parse']}x", "< 1 s")
           for f in r["files"]]
    s = r["sglang_deepseek_v2"]
    if s.get("refused"):
        out.append((f"sglang srt/models/deepseek_v2.py ({s['lines']} lines): refused (two-batch-overlap bypass)",
                    _s(s["time_to_refuse_s"]), "", "", "< 1 s"))
    return out


def rows_coverage(r: dict) -> list[Row]:
    c, base = r["coverage"], r["baseline_parse_all"]
    out = [(f"coverage of both engines ({base['files']} files, {base['lines']} lines)", _s(c["seconds"]),
            f"libcst parse of every model file {_s(base['seconds'])}", f"{r['ratio_baseline_over_coverage']}x faster",
            "< 15 s on 2 cores")]
    for engine, e in c["engines"].items():
        out.append((f"{engine}: decoder classes patchable", f"{e['decoder_fraction']:.1%}", "", "", ">= 90%"))
        if "decoder_fraction_with_guard" in e:
            out.append((f"{engine}: decoder classes patchable, with --guard-bypass",
                        f"{e['decoder_fraction_with_guard']:.1%}", "", "", ">= 90%"))
    for x in r.get("rewrite", []):
        out.append((f"rewrite {x['file']} ({x['lines']} lines): {x['outcome']}", _s(x["seconds"]), "", "", ""))
    return out


def rows_vllm(r: dict) -> list[Row]:
    m, w = r["model"], r["workload"]
    what = f"vLLM CPU, Llama hidden {m['hidden']} x {m['layers']} layers, {w['batch']} x {w['tokens']} tokens"
    base = r["results"][r["baseline"]]
    out = []
    for cfg, x in r["results"].items():
        if cfg == r["baseline"]:
            continue
        for phase in ("prefill", "decode"):
            out.append((f"{what}, {phase}: {cfg}", _ms(x[f"{phase}_ms"]), f"{r['baseline']} {_ms(base[f'{phase}_ms'])}",
                        f"{x[f'{phase}_ratio']:.3f}x time", "hooks <= native" if cfg == "hooks" else ""))
    return out


def rows_matrix(r: dict) -> list[Row]:
    out = []
    for name, e in r.items():
        for verb in ("conventions", "coverage"):
            out.append((f"surgeon {verb}, cold, {name} ({e['files']} model files, {e['lines']} lines)",
                        _s(e[f"{verb}_s"]), f"libcst parse of every model file {_s(e['baseline_parse_all_s'])}",
                        f"{e[f'{verb}_speedup']}x faster", f"< {e['target_s']} s"))
    return out


def rows_plan(r: dict) -> list[Row]:
    return [(f"surgeon plan {e['spec']} --engine {engine} (4 routes x 2 needs, warm probe)", _s(e["plan_s"]),
             f"surgeon render --engine {engine} {_s(e['render_s'])}", f"{e['ratio']}x the time",
             f"< {e['target_s']:.0f} s") for engine, e in r.items()]


def rows_accept(r: dict) -> list[Row]:
    return [(f"accept, {r['prompts']} prompts x {r['length']} tokens x {r['wirings']} wirings "
             f"(target {_s(r['ours_target_s'])} once, draft {_s(r['ours_draft_s'])})", _s(r["ours_s"]),
             f"{r['baseline']} {_s(r['baseline_s'])} ({r['baseline_timed_wirings']} timed, scaled)",
             f"{r['speedup']}x faster", f"< {r['budget_s']:.0f} s")]


def rows_infer(r: dict) -> list[Row]:
    naive = f"{r['naive_per_candidate_s']} s x {r['naive_candidates']:,}" + (" (estimated)" if r["naive_is_estimate"] else "")
    return [(f"infer-wiring, Kimi shape ({r['points']} points, hidden {r['hidden']}, {r['tokens']} tokens): "
             f"search {_s(r['search_s'])} + behaviour on {r['behaviour_candidates']} candidates {_s(r['behaviour_s'])}, "
             f"{'named the true wiring' if r['correct'] else 'DID NOT name the true wiring'}",
             _s(r["ours_total_s"]), f"naive: a chained draft forward per candidate, {naive}",
             f"{r['speedup']:,.0f}x", f"< {r['budget_s']:.0f} s")]


def rows_audit(r: dict) -> list[Row]:
    rd, n = r["rounds"], len(r["rounds"]["raw_read"])
    one = _median([a["bytes_per_s"] for a in rd["audit_1_worker"]])
    two = _median([a["bytes_per_s"] for a in rd["audit_2_workers"]])
    raw = _median([x["bytes_per_s"] for x in rd["raw_read"]])
    what = f"{r['files']} SpecForge samples (hidden {r['hidden']}, {r['lengths']} tokens) linked {r['links']} times"
    dflt = r.get("default_workers", 1)
    runs = rd.get("audit_default_workers") or (rd["audit_1_worker"] if dflt == 1 else rd["audit_2_workers"])
    out = [(f"audit, default --workers ({dflt}, one per usable core), page cache warm: {what} (median of {n} rounds)",
            f"{_median([a['bytes_per_s'] for a in runs]) / 1e9:.2f} GB/s",
            f"raw sequential read (the faster of a 128 KB and a 16 MB buffer), warm {raw / 1e9:.2f} GB/s",
            f"{r.get('ratio_default_vs_raw_read', r['ratio_audit_vs_raw_read']):.3f}x", ">= 0.5x"),
           (f"audit, 1 worker, page cache warm (median of {n} rounds)", f"{one / 1e9:.2f} GB/s",
            f"raw sequential read, warm {raw / 1e9:.2f} GB/s", f"{r['ratio_audit_vs_raw_read']:.3f}x", "reported"),
           (f"audit, 2 workers vs 1, warm (controls, 2 processes vs 1: a busy loop {r['control_2_vs_1_processes']:.2f}x, "
            f"the raw read {r['raw_read_2_vs_1_processes']:.2f}x)",
            f"{two / 1e9:.2f} GB/s", f"1 worker {one / 1e9:.2f} GB/s", f"{r['ratio_2_vs_1_workers']:.2f}x", ">= 1.6x")]
    c = r.get("cold")
    if c:
        out.append((f"audit, 1 worker, page cache emptied (from disk): {c['files']} samples, {c['bytes'] / 1e9:.2f} GB",
                    f"{c['audit_1_bytes_per_s'] / 1e9:.2f} GB/s",
                    f"raw sequential read, cold {c['raw_read_bytes_per_s'] / 1e9:.2f} GB/s",
                    f"{c['ratio_audit_vs_raw_read']:.2f}x", ">= 0.5x"))
    m = r["memory"]
    out.append((f"audit peak RSS, {m['files'][0]} vs {m['files'][1]} files", f"{m['maxrss_kb'][1] / 1024:.0f} MB",
                f"{m['maxrss_kb'][0] / 1024:.0f} MB", f"{m['maxrss_kb'][1] / m['maxrss_kb'][0]:.2f}x", "flat"))
    im = r.get("index_memory")
    if im:
        out.append((f"audit driver: cross-file index of sampled rows, {im['files']:,} files ({im['rows']:,} rows), peak "
                    f"(tracemalloc; {im['index_us_per_file']:.0f} us a file)", f"{im['index_peak_bytes'] / 1e6:.0f} MB",
                    f"a dict of (context, path, slot) tuples {im['dict_peak_bytes'] / 1e6:.0f} MB",
                    f"{im['dict_peak_bytes'] / im['index_peak_bytes']:.1f}x less", "flat"))
    if "structure_pass" in r:
        sp = r["structure_pass"]
        out.append((f"audit --structure-only, {sp['files']:,} files", _s(sp["seconds"]), "", f"{sp['files_per_s']:.0f} files/s",
                    "reported"))
    return out


def rows_audit_lengths(r: dict) -> list[Row]:
    lengths = ",".join(r["by_length"])
    return [(f"audit identity, false alarms on {r['files']} clean samples of {lengths} tokens (hidden {r['hidden']}, "
             f"8 layers; profile of {r['prompts']} prompts): the ladder of per-length profiles",
             f"{r['ladder_flagged']} flagged", f"one profile of the same prompts, whole: {r['whole_prompts_flagged']} flagged",
             f"{r['whole_prompts_flagged'] - r['ladder_flagged']} fewer" if r["whole_prompts_flagged"] >= r["ladder_flagged"]
             else f"{r['ladder_flagged'] - r['whole_prompts_flagged']} more", "0")]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


# name -> (command, rows); commands run from the repository root with this interpreter
BENCHMARKS: dict[str, tuple[list[str], Callable[[dict], list[Row]]]] = {
    "probe": (["benchmarks/probe.py", "--json"], rows_probe),
    "coverage": (["benchmarks/patch.py", "--json"], rows_coverage),
    "matrix": (["benchmarks/matrix.py", "--json"], rows_matrix),
    "apply": (["benchmarks/apply.py", "--json"], rows_apply),
    "plan": (["benchmarks/plan.py", "--json"], rows_plan),
    "hooks": (["benchmarks/hooks.py", "--json"], rows_hooks),
    "dumps": (["benchmarks/dumps.py", "--json"], rows_dumps),
    "identify": (["benchmarks/identify.py", "--json"], rows_identify),
    "vllm": (["benchmarks/vllm_aux.py", "--json"], rows_vllm),
    "accept": (["benchmarks/accept.py", "--json"], rows_accept),
    "infer_wiring": (["benchmarks/infer_wiring.py", "--json"], rows_infer),
    "audit": (["benchmarks/audit.py", "--json"], rows_audit),
    "audit_lengths": (["benchmarks/audit_lengths.py", "--json"], rows_audit_lengths),
}


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS),
                    help="rerun only these; the others keep their last figures from benchmarks/results/")
    ap.add_argument("--output", type=Path, default=HERE / "REPORT.md")
    a = ap.parse_args()
    results_dir = HERE / "results"
    results_dir.mkdir(exist_ok=True)
    table: list[tuple[str, Row, str]] = []
    failures: list[str] = []
    for name in BENCHMARKS:
        cmd, rows = BENCHMARKS[name]
        if a.only and name not in a.only:  # not rerun: the table keeps its last measured figures
            kept = results_dir / f"{name}.json"
            if kept.exists():
                shown = " ".join([".venv/bin/python", *cmd])
                table += [(name, row, shown) for row in rows(json.loads(kept.read_text()))]
            continue
        if not (REPO / cmd[0]).exists():
            failures.append(f"{name}: {cmd[0]} does not exist")
            continue
        shown = " ".join([".venv/bin/python", *cmd])
        print(f"[{name}] {shown}", file=sys.stderr, flush=True)
        t = time.perf_counter()
        p = subprocess.run([sys.executable, *cmd], cwd=REPO, capture_output=True, text=True)
        took = time.perf_counter() - t
        try:
            if p.returncode != 0:
                raise RuntimeError(f"exit {p.returncode}")
            data = json.loads(p.stdout[p.stdout.index("{"):])
            got = rows(data)
        except Exception as e:  # one failed benchmark must not hide the others
            tail = " / ".join(p.stderr.strip().splitlines()[-3:])
            failures.append(f"{name} ({shown}): {type(e).__name__}: {e}; {tail}")
            print(f"  failed after {took:.0f} s", file=sys.stderr)
            continue
        (results_dir / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
        print(f"  {len(got)} figure(s) in {took:.0f} s", file=sys.stderr)
        table += [(name, row, shown) for row in got]

    lines = [
        "# Benchmark report",
        "",
        f"Written by `.venv/bin/python benchmarks/report.py` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.machine()}, {_cpus()} CPU(s), Python {platform.python_version()}. "
        "Raw JSON of each run: `benchmarks/results/`"
        + (f"; rerun here: {', '.join(a.only)}, the other figures are from their last run." if a.only else "."),
        "",
        "| benchmark | figure | measured | baseline | ratio | target | command |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (fig, measured, base, ratio, target), cmd in table:
        lines.append(f"| {name} | {_md(fig)} | {_md(measured)} | {_md(base)} | {_md(ratio)} | {_md(target)} | `{cmd}` |")
    if failures:
        lines += ["", "## Not measured in this run", ""] + [f"- {_md(f)}" for f in failures]
    a.output.write_text("\n".join(lines) + "\n")
    print(f"wrote {a.output}", file=sys.stderr)
    return 1 if failures else 0


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


if __name__ == "__main__":
    sys.exit(main())
