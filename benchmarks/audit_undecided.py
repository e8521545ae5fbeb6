"""Benchmark (accuracy and cost): the audit on a target whose points do not separate, with seeded
shifted and off-by-one labels, before and after the escalation to exact identification, in one run.

    .venv/bin/python benchmarks/audit_undecided.py [--json] [--files 300] [--faults 18] [--hidden 128]
                                                   [--set DIR] [--base REV]

A tiny 8-layer Llama of ``--hidden`` (random weights, seed 0) with its residual branches scaled to a
~2% adjacent-layer gap (``surgeon.run.tinymodels.GAP_SCALES``: consecutive layers as close as a deep
model's, so the identity statistics leave every aux slot ``unresolved``), and a synthetic speculators
set of ``--files`` samples of 64-128 tokens (``surgeon.audit.synthetic``), ``--faults`` of them
seeded half with labels shifted by a slot, half with every aux slot off by one layer (``--set DIR``:
made there once and reused). The set is audited (one worker, ``--reference hf:``, one profile built
once) three ways:

* ``statistics``: ``--exact 0``: the identity statistics alone;
* ``before``: ``--exact 4``: what the audit did by default before the escalation, 4 evenly spaced
  files identified exactly (every file is undecided here, so the escalation's 4 are the same
  evenly spaced files the old default picked), exit 0 or 3 only;
* ``after``: the default, ``--exact auto``: every undecided file identified exactly when the target
  is small (parameters x tokens <= ``surgeon.audit.exact.PARAM_TOKENS``);

and, where ``--base REV`` is given, ``base``: the CLI of that commit (``git archive``d into a temporary
directory, nothing of this checkout touched) with its defaults (``--json --workers 1``) on the same set:
the baseline as it was, its exit status and ``ok`` included.

For each: the seeded faults reported (the file has an identity or exact finding; ``faults_flagged``:
any finding, the stale check's included: two shifted files' low slots hold embedding rows, which
depend on the token alone, so one may look like a stale copy of the other), those *named* (a
finding on the low slot names what it holds: ``embed`` for a shift, ``layer_out[1]`` for an
off-by-one), clean files flagged, the verdict and exit status, the undecided slots; for ``after``
the wall time of the escalation, per file, and in parameter-tokens a second. The CPU is shared
with whatever else runs: times move with the machine's load (``load_1m`` says what it was).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAMED = {"shifted": "embed", "off_by_one": "layer_out[1]"}  # what the low slot (declared layer_out[0]) holds


def _make(root: Path, files: int, faults: int, hidden: int) -> dict[str, str]:
    """The set under ``root`` (made once), and its map of file name -> seeded fault."""
    from surgeon.audit.synthetic import make_synthetic_set
    from surgeon.run.tinymodels import GAP_SCALES, make_tiny_model

    manifest = root / "faults.json"
    if not manifest.exists():
        make_tiny_model("llama", root / "model", num_layers=8, hidden_size=hidden, seed=0,
                        residual_scale=GAP_SCALES["llama"])
        s = make_synthetic_set(root, root / "model", files=files, layout="speculators", count=faults // 2, seed=5,
                               kinds=("shifted", "off_by_one"))
        manifest.write_text(json.dumps(s.faults))
    return json.loads(manifest.read_text())


def _audit(root: Path, built, exact: int | None, faults: dict[str, str]) -> dict:
    from surgeon.audit.pipeline import Plan, run_audit
    from surgeon.commands.outputs import json_output

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        rep = run_audit(Plan(root / "set", str(root / "spec.yaml"), workers=1, exact_files=exact, built=built,
                             state_path=Path(tmp) / "s.jsonl"))
        wall = time.perf_counter() - t
    j = json_output("audit", rep)
    ex = j["exact"]
    out = {"exact": "auto" if exact is None else exact, **_faults(j, faults), "verdict": j["verdict"],
           "exit": rep.exit_code, "ok": j["ok"], "undecided_slots": j["undecided"], "exact_files": ex["files"],
           "escalated": ex["escalated"], "audit_s": round(wall, 2), "escalation_s": ex["seconds"],
           "unresolved": {s["name"]: s["verdicts"]["unresolved"] for s in j["slots"]}}
    if ex["files"] == j["files"] and ex["params"]:  # every file identified exactly: the rate over all their tokens
        tokens = sum(_tokens(p) for p in (root / "set").iterdir() if not p.name.startswith("."))
        out.update(params=ex["params"], per_file_s=round(ex["seconds"] / ex["files"], 3),
                   param_tokens_per_s=float(f"{ex['params'] * tokens / max(ex['seconds'], 1e-9):.3g}"))
    return out


def _faults(j: dict, faults: dict[str, str]) -> dict[str, int]:
    flagged = {Path(o["path"]).name: o["findings"] for o in j["outliers"]}
    reported = [n for n in faults if any(f["kind"] in ("identity", "exact") for f in flagged.get(n, ()))]
    named = [n for n in faults if any(f["kind"] in ("identity", "exact") and f["slot"] == "low"
                                      and f"as {NAMED[faults[n]]}" in f["detail"] for f in flagged.get(n, ()))]
    return {"faults_reported": len(reported), "faults_named": len(named),
            "faults_flagged": len(set(flagged) & set(faults)), "clean_files_flagged": len(set(flagged) - set(faults))}


def _base(rev: str, root: Path, faults: dict[str, str]) -> dict:
    """The CLI of commit ``rev`` with its defaults on the set: its exit status, ``ok`` and faults."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        archive = subprocess.run(["git", "archive", rev], cwd=repo, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        t = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "surgeon", "audit", str(root / "set"), "--spec",
                              str(root / "spec.yaml"), "--reference", f"hf:{root / 'model'}", "--workers", "1",
                              "--state", str(Path(tmp) / "s.jsonl"), "--json"], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tmp)
        wall = time.perf_counter() - t
    j = json.loads(res.stdout)
    return {"rev": rev, "format": j["format"], **_faults(j, faults), "exit": res.returncode, "ok": j["ok"],
            "exact_files": j["exact"]["files"],
            "audit_s": round(wall, 2)}


def _tokens(path: Path) -> int:
    from surgeon.audit.structure import read_structure

    return int(read_structure(str(path)).tokens or 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--files", type=int, default=300)
    ap.add_argument("--faults", type=int, default=18)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--set", help="make the set here once, and reuse it")
    ap.add_argument("--base", help="also run this commit's CLI, with its defaults, on the set (the baseline as it was)")
    a = ap.parse_args()
    from surgeon.audit.reference import build_profile
    from surgeon.audit.structure import discover
    from surgeon.core.spec import load_spec

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.set or tmp)
        faults = _make(root, a.files, a.faults, a.hidden)
        paths = [str(p) for p in discover((root / "set").resolve())]
        built = build_profile(f"hf:{root / 'model'}", load_spec(root / "spec.yaml"), paths, [])
        runs = {"statistics": _audit(root, built, 0, faults), "before": _audit(root, built, 4, faults),
                "after": _audit(root, built, None, faults)}
        if a.base:
            runs["base"] = _base(a.base, root, faults)
    out = {"files": len(paths), "faults": len(faults), "hidden": a.hidden, "cpus": os.cpu_count(),
           "load_1m": round(os.getloadavg()[0], 2), **runs}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{out['files']} files, {out['faults']} seeded faults (shifted, off by one) on a target whose points do not "
          f"separate (hidden {a.hidden}, 8 layers)")
    for name, r in runs.items():
        print(f"{name:>10} (--exact {r.get('exact', r.get('rev'))}): {r['faults_reported']} of {out['faults']} faults "
              f"reported, {r['faults_named']} named; {r['clean_files_flagged']} clean files flagged; exit {r['exit']}, "
              f"ok {r['ok']}; {r['exact_files']} files identified exactly in {r.get('escalation_s', '-')} s")


if __name__ == "__main__":
    main()
