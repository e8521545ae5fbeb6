"""Benchmark: identification verdicts on targets the tests never use, counted by kind (issue 32's
"never a confident wrong verdict"). Four model families the tests do not identify against (qwen2,
qwen3, mistral, deepseek_v3), residual branches scaled from x0.3 to x3e-4 (at the small end
consecutive layers differ by less than bf16 rounding: the points do not separate), slots in fp32,
bf16 and fp16, against the full reference and against a 64-wide fingerprint:

* every point labelled correctly: each slot must come out ``ok`` or ``undecided``, never wrong;
* every slot holding the next point's state (off by one): ``mismatch`` or ``undecided``, never ``ok``.

    .venv/bin/python benchmarks/heldout_verdicts.py [--json] [--seed 11]

The baseline named in the report is the rule before the ``undecided`` verdict, counted from the same
runs: a slot whose best points tie was ``no_match`` (a confident "not what was declared") whatever
its declared point, so each ``undecided`` on a correct slot was a false alarm there.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from surgeon.core.points import all_points  # noqa: E402
from surgeon.run.tinymodels import make_tiny_model  # noqa: E402
from surgeon.verify.fingerprint import fingerprint  # noqa: E402
from surgeon.verify.identify import identify  # noqa: E402
from surgeon.verify.reference import capture_reference  # noqa: E402

FAMILIES = ("qwen2", "qwen3", "mistral", "deepseek_v3")
SCALES = (None, 0.3, 0.03, 3e-3, 3e-4)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYERS = 6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    counts: dict[str, dict[str, int]] = {"correct": {}, "off_by_one": {}}
    wrong: list[dict] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for fam in FAMILIES:
            for rs in SCALES:
                model = make_tiny_model(fam, Path(tmp) / f"{fam}-{rs}", num_layers=LAYERS, seed=args.seed,
                                        residual_scale=rs)
                ids = torch.randint(3, 200, (48,), generator=torch.Generator().manual_seed(args.seed)).tolist()
                ref = capture_reference(model, ids)
                pts = all_points(LAYERS)
                for reference, kind in ((ref, "reference"), (fingerprint(ref, dim=64, seed=0), "fingerprint")):
                    for dt in DTYPES:
                        cases = {"correct": [(str(p), p, ref.states[p].to(dt)) for p in pts],
                                 "off_by_one": [(str(a), a, ref.states[b].to(dt)) for a, b in zip(pts, pts[1:])]}
                        for case, slots in cases.items():
                            for s in identify(slots, reference).slots:
                                counts[case][s.verdict] = counts[case].get(s.verdict, 0) + 1
                                bad = s.verdict not in ("ok", "undecided") if case == "correct" else s.verdict == "ok"
                                if bad:
                                    wrong.append({"case": case, "family": fam, "residual_scale": rs, "dtype": str(dt),
                                                  "reference": kind, "slot": s.name, "verdict": s.verdict})
    out = {"counts": counts, "confidently_wrong": len(wrong), "wrong": wrong[:20],
           "baseline_false_alarms_on_correct_slots": counts["correct"].get("undecided", 0),
           "seconds": round(time.perf_counter() - t0, 1)}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"correct slots: {counts['correct']}; off by one: {counts['off_by_one']}")
        print(f"confidently wrong: {len(wrong)} (baseline rule: {out['baseline_false_alarms_on_correct_slots']} "
              f"correct slots judged 'no_match'); {out['seconds']} s")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
