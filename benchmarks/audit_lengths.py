"""Benchmark (accuracy): false alarms of the audit's identity pass on clean samples of many lengths,
the ladder of per-length profiles against one profile of whole prompts, in one run.

    .venv/bin/python benchmarks/audit_lengths.py [--json] [--files 400] [--hidden 256]
                                                 [--lengths 8,16,32,64,128,256,512,1024] [--set DIR]

A tiny 8-layer Llama of ``--hidden`` (random weights, seed 0) and a synthetic speculators set of
``--files`` clean samples (no seeded fault), each on its own tokens, of ``--lengths`` tokens
(``--set DIR``: made there once and reused). The set is audited (one worker, ``--reference hf:``,
no exact identification) twice with the same profile, built once from the same prompts: judged
against the ladder (each sample against the rung of its length, what ``surgeon audit`` does) and
against the profile of whole prompts (``Profile.at`` returning the whole profile: what it did
before the ladder). Every flagged file is a false alarm. The baseline is named: the whole-prompt
profile's flagged files; per length, how many of its samples each flags.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _make(root: Path, files: int, hidden: int, lengths: tuple[int, ...]) -> Path:
    from surgeon.audit.synthetic import make_synthetic_set
    from surgeon.run.tinymodels import make_tiny_model

    if not (root / "spec.yaml").exists():
        make_tiny_model("llama", root / "model", num_layers=8, hidden_size=hidden, seed=0)
        make_synthetic_set(root, root / "model", files=files, layout="speculators", count=0, seed=2, lengths=lengths)
    return root


def _flagged(root: Path, whole: bool) -> tuple[Counter, Counter, int]:
    """(flagged files by length, files by length, profile prompts) of one audit of the set."""
    from surgeon.audit.pipeline import Plan, run_audit
    from surgeon.audit.profile import Profile
    from surgeon.commands.outputs import json_output

    at = Profile.at
    if whole:
        Profile.at = lambda self, tokens: self  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rep = run_audit(Plan(root / "set", str(root / "spec.yaml"), reference=f"hf:{root / 'model'}", workers=1,
                                 exact_files=0, state_path=Path(tmp) / "s.jsonl"))
    finally:
        Profile.at = at  # type: ignore[method-assign]
    lengths = _lengths(root)
    flagged = Counter(lengths[Path(o["path"]).name] for o in json_output("audit", rep)["outliers"])
    return flagged, Counter(lengths.values()), rep.profile.prompts if rep.profile else 0


def _lengths(root: Path) -> dict[str, int]:
    from surgeon.audit.structure import discover, read_structure

    return {p.name: int(read_structure(p).tokens or 0) for p in discover(root / "set")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--files", type=int, default=400)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lengths", default="8,16,32,64,128,256,512,1024")
    ap.add_argument("--set", help="make the set here once, and reuse it")
    a = ap.parse_args()
    lengths = tuple(int(x) for x in a.lengths.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        root = _make(Path(a.set or tmp), a.files, a.hidden, lengths)
        ladder, per, prompts = _flagged(root, whole=False)
        whole, _, _ = _flagged(root, whole=True)
    n = sum(per.values())
    out = {"files": n, "hidden": a.hidden, "prompts": prompts,
           "by_length": {str(t): {"files": per[t], "ladder": ladder[t], "whole_prompts": whole[t]} for t in sorted(per)},
           "ladder_flagged": sum(ladder.values()), "whole_prompts_flagged": sum(whole.values())}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"clean samples: {n} (hidden {a.hidden}, 8 layers), profile of {prompts} prompts")
    print(f"{'tokens':>7} {'files':>6} {'ladder':>7} {'whole prompts (baseline)':>25}")
    for t in sorted(per):
        print(f"{t:>7} {per[t]:>6} {ladder[t]:>7} {whole[t]:>25}")
    print(f"false alarms: ladder {out['ladder_flagged']} of {n}, whole prompts {out['whole_prompts_flagged']} of {n}")


if __name__ == "__main__":
    main()
