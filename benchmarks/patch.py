"""Benchmark: patch coverage of both installed engines against the naive baseline of parsing
every model file with libcst (measured in the same run), and the rewrite of sglang's
srt/models/deepseek_v2.py (refused for its two-batch-overlap bypass: the refusal is timed, and the
rewrite with the runtime bypass guard) and of a large patchable file.

    .venv/bin/python benchmarks/patch.py [--json]
"""

from __future__ import annotations

import json
import sys
import time

import libcst

from surgeon.engines.source.locate import layout_of, locate_engine
from surgeon.patch.coverage import coverage
from surgeon.patch.rewriter import PatchApplicationError, find_recipe, load_recipes, rewrite


def _baseline() -> tuple[float, int, int]:
    nfiles = nlines = 0
    start = time.perf_counter()
    for engine in ("sglang", "vllm"):
        loc = locate_engine(engine)
        for f in sorted((loc.root / layout_of(engine).models_dir).rglob("*.py")):
            text = f.read_text(encoding="utf-8")
            nfiles += 1
            nlines += text.count("\n")
            libcst.parse_module(text)
    return time.perf_counter() - start, nfiles, nlines


def _time_rewrite(engine: str, rel: str, cls: str, **kw) -> dict:
    loc = locate_engine(engine)
    src = (loc.root / rel).read_bytes()
    recipe = find_recipe(load_recipes(), engine=engine, relpath=rel, class_name=cls)
    t = time.perf_counter()
    try:
        res = rewrite(src, relpath=rel, class_name=cls, positions={3, 31, 59}, capture_final=True, recipe=recipe, **kw)
        outcome = f"patched ({res.inserted} statements)"
    except PatchApplicationError as exc:
        outcome = f"refused: {exc.anchor}"
    return {"file": rel, "class": cls, **kw, "lines": src.count(b"\n"), "seconds": round(time.perf_counter() - t, 3),
            "outcome": outcome}


def main() -> None:
    t = time.perf_counter()
    rep = coverage("all", jobs=2)
    cov_s = time.perf_counter() - t
    base_s, nfiles, nlines = _baseline()
    out = {
        "coverage": {"seconds": round(cov_s, 3), "engines": {
            ec.engine: {"decoder_fraction": round(ec.fraction, 4),
                        "decoder_fraction_with_guard": round(ec.fraction_guarded, 4),
                        "all_fraction": round(ec.fraction_all, 4),
                        "files": ec.files, "files_parsed": ec.files_parsed} for ec in rep.engines}},
        "baseline_parse_all": {"seconds": round(base_s, 3), "files": nfiles, "lines": nlines},
        "ratio_baseline_over_coverage": round(base_s / cov_s, 2),
        "rewrite": [
            _time_rewrite("sglang", "srt/models/deepseek_v2.py", "DeepseekV2Model"),
            _time_rewrite("sglang", "srt/models/deepseek_v2.py", "DeepseekV2Model", guard_bypass=True),
            _time_rewrite("sglang", "srt/models/qwen3_next.py", "Qwen3NextModel"),
        ],
    }
    if "--json" in sys.argv:
        print(json.dumps(out))
        return
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
