"""Benchmark: `surgeon plan` (every route judged: the serving config, the native path's source
facts, the plugin and the patch planner per need) against the baseline of `surgeon render` of the
same spec (the serving config alone), in one run, on the installed engines with their probes
already cached (each measured as the command runs, inside one engine session).

    .venv/bin/python benchmarks/plan.py [--json] [--repeat 3]

Prints per engine the seconds of plan and render (best of --repeat) and their ratio: what judging
all four routes costs over rendering one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from surgeon import commands  # noqa: E402
from surgeon.engines.probes.native import clear_cache  # noqa: E402

SPEC = str(Path(__file__).resolve().parents[1] / "specs" / "llama-3.1-8b-eagle3.yaml")
TARGET_S = 10.0  # a plan should answer well inside a review's attention span


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        clear_cache()  # the native facts are read again each time, as a fresh command would
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    commands.render(spec=SPEC, target="vllm")  # warm the probe caches of both engines once
    commands.render(spec=SPEC, target="sglang")
    out = {}
    for engine in ("vllm", "sglang"):
        plan_s = _best(lambda e=engine: commands.plan(spec=SPEC, engine=e), args.repeat)
        render_s = _best(lambda e=engine: commands.render(spec=SPEC, target=e), args.repeat)
        out[engine] = {"spec": Path(SPEC).name, "plan_s": round(plan_s, 3), "render_s": round(render_s, 3),
                       "ratio": round(plan_s / render_s, 1), "target_s": TARGET_S}
    if args.json:
        print(json.dumps(out))
    else:
        for engine, r in out.items():
            print(f"{engine}: plan {r['plan_s']} s, render {r['render_s']} s ({r['ratio']}x), target < {TARGET_S} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
