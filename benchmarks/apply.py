"""Benchmark: `apply` + `revert` end to end (spec load, rewrite, hooks generation, journaled
transaction, byte-identical restore) on the largest model file of each engine, against the named
baseline "libcst parse of that file alone", in one run, on copies of the installed engines.

    .venv/bin/python benchmarks/apply.py [--json] [--repeat 5]

Files: vLLM's model_executor/models/deepseek_v2.py with specs/kimi-k2.5-eagle3.yaml (the
Kimi-K2.5 model file), and SGLang's srt/models/deepseek_v2.py (3,595 lines), which surgeon
refuses by default for its two-batch-overlap bypass (layers run there would not be captured): the
time to reach that refusal is reported, then the file is timed with ``--guard-bypass`` (a runtime
guard that raises if that path would run a captured layer), and a plain patchable SGLang file too.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import libcst

from surgeon.core.errors import BadInput
from surgeon.core.spec import load_spec
from surgeon.engines.source.locate import copy_engine_sources
from surgeon.patch.apply import apply_spec, revert_patch

REPO = Path(__file__).resolve().parent.parent
KIMI = REPO / "specs/kimi-k2.5-eagle3.yaml"


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _parse(path: Path) -> None:
    libcst.parse_module(path.read_bytes())


def _round_trip(spec, engine: str, root: Path, relpath: str, **kw) -> None:
    before = (root / relpath).read_bytes()
    apply_spec(spec, engine=engine, engine_root=root, model_file=relpath, **kw)
    revert_patch(engine=engine, engine_root=root)
    assert (root / relpath).read_bytes() == before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    report: dict = {"baseline": "libcst parse of the same file alone", "target_s": 1.0}
    with tempfile.TemporaryDirectory() as tmp:
        spec = load_spec(KIMI)
        rows = []
        vroot = copy_engine_sources("vllm", Path(tmp) / "v")
        rel = "model_executor/models/deepseek_v2.py"
        rows.append(("vllm", rel, KIMI.name, vroot, {}))
        sroot = copy_engine_sources("sglang", Path(tmp) / "s")
        srel = "srt/models/deepseek_v2.py"
        t = time.perf_counter()
        try:
            apply_spec(spec, engine="sglang", engine_root=sroot)
            refused = None
        except BadInput as e:
            refused = str(e)
        report["sglang_deepseek_v2"] = {"lines": (sroot / srel).read_bytes().count(b"\n"),
                                        "refused": refused, "time_to_refuse_s": round(time.perf_counter() - t, 3)}
        if refused is None:
            revert_patch(engine="sglang", engine_root=sroot)
            rows.append(("sglang", srel, KIMI.name, sroot, {}))
        # the same file with the runtime guard on its two-batch-overlap path (--guard-bypass)
        rows.append(("sglang", srel, KIMI.name + " --guard-bypass", sroot,
                     {"guard_bypass": True, "loop_class": "DeepseekV2Model"}))
        # the largest SGLang model file surgeon patches, with the same spec's points
        for cand in ("srt/models/qwen3_moe.py", "srt/models/llama.py"):
            try:
                apply_spec(spec, engine="sglang", engine_root=sroot, model_file=cand, loop_class=None)
                revert_patch(engine="sglang", engine_root=sroot)
                rows.append(("sglang", cand, KIMI.name, sroot, {}))
                break
            except BadInput:
                continue
        out = []
        for engine, relpath, spec_name, root, kw in rows:
            # partial binds this row's values (_best calls them right away, but a lambda would read the loop's)
            base = _best(partial(_parse, root / relpath), a.repeat)
            total = _best(partial(_round_trip, spec, engine, root, relpath, **kw), a.repeat)
            out.append({"engine": engine, "file": relpath, "spec": spec_name,
                        "lines": (root / relpath).read_bytes().count(b"\n"),
                        "libcst_parse_s": round(base, 3), "apply_revert_s": round(total, 3),
                        "ratio_to_parse": round(total / base, 2), "under_target": total < 1.0})
        report["files"] = out
    if a.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return
    print(f"apply + revert end to end (best of {a.repeat}), baseline: {report['baseline']}")
    for r in report["files"]:
        print(f"  {r['engine']:6s} {r['file']:40s} {r['lines']:5d} lines  parse {r['libcst_parse_s']:.3f} s  "
              f"apply+revert {r['apply_revert_s']:.3f} s  ({r['ratio_to_parse']}x parse; target < 1 s: "
              f"{'met' if r['under_target'] else 'MISSED'})")
    s = report["sglang_deepseek_v2"]
    if s["refused"]:
        print(f"  sglang srt/models/deepseek_v2.py ({s['lines']} lines): refused in {s['time_to_refuse_s']} s: {s['refused']}")


if __name__ == "__main__":
    main()
