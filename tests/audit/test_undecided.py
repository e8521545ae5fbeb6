"""Undecided is a verdict: an audit whose identity statistics cannot tell a target's points apart
says so first (exit 4, per-slot counts in the text, the JSON and the HTML, the faults it cannot
see), never "clean"; it escalates to exact identification (the target run on each file's own
tokens) within a stated budget, which finds and names shifted and off-by-one labels; a target whose
points separate stays exit 0 with its counts shown."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from surgeon.audit import exact as exact_mod
from surgeon.audit.exact import PARAM_TOKENS, SPOT, ExactRun, open_slots, parameters, select
from surgeon.audit.pipeline import Plan, run_audit
from surgeon.cli import main
from surgeon.commands import FORMATS, schema
from surgeon.commands.outputs import json_output
from surgeon.core.errors import UNDECIDED

AUX = ("low", "mid", "high")
TRUE_LOW = {"shifted": "embed", "off_by_one": "layer_out[1]"}  # what the low slot holds (declared layer_out[0])


def _cli(*args, code: int):
    res = CliRunner().invoke(main, ["audit", *map(str, args)])
    assert res.exit_code == code, res.output
    return res


def _clean(synthetic, dest: Path) -> Path:
    dest.mkdir()
    for p in synthetic.root.iterdir():
        if p.name not in synthetic.faults and not p.name.startswith("."):
            os.symlink(p, dest / p.name)
    return dest


def _flagged(j: dict) -> dict[str, list[dict]]:
    return {Path(o["path"]).name: o["findings"] for o in j["outliers"]}


def test_a_target_whose_points_do_not_separate_is_undecided_never_clean(flat_set, flat_target, tmp_path):
    root = _clean(flat_set, tmp_path / "clean")
    args = (root, "--spec", flat_set.spec, "--reference", f"hf:{flat_target}", "--exact", "0", "--workers", "1")
    data = json.loads(_cli(*args, "--state", tmp_path / "a.jsonl", "--json", code=UNDECIDED).stdout)
    assert data["format"] == FORMATS["audit"] == 2
    assert not list(jsonschema.Draft202012Validator(schema(output="audit").schema).iter_errors(data))
    assert data["ok"] is False and data["verdict"] == "undecided" and data["flagged"] == 0
    assert set(AUX) <= set(data["undecided"])
    assert any("off by one layer" in c for c in data["cannot_see"]) and any("shifted" in c for c in data["cannot_see"])
    files = data["files"]
    for s in data["slots"]:
        assert set(s["verdicts"]) == {"ok", "mismatch", "no_match", "unresolved", "not_run"}
        assert sum(s["verdicts"].values()) == s["files"] == files
        if s["name"] in AUX:
            assert s["verdicts"]["unresolved"] == s["undecided"] > files // 2, s
    text = _cli(*args, "--state", tmp_path / "b.jsonl", code=UNDECIDED).stdout.splitlines()
    assert text[0].startswith("undecided: identity undecided for most files of"), text[0]
    assert "a slot off by one layer" in text[0] and "labels shifted by a slot" in text[0]
    assert "--exact 0" in text[0] and "every file is what the spec declares" not in "\n".join(text)
    low = next(line for line in text if line.strip().startswith("low identity:"))  # the summary's per-slot counts
    assert f"unresolved {files}" in low or f"unresolved {files - 1}" in low, low
    assert "more" in next(line for line in text if line.startswith("│ low")), text  # "+N more" past 4 points


def test_without_exact_identification_the_seeded_faults_go_unseen_and_the_run_says_so(flat_set, flat_target, tmp_path):
    rep = run_audit(Plan(flat_set.root, str(flat_set.spec), reference=f"hf:{flat_target}", exact_files=0, workers=1,
                         state_path=tmp_path / "s.jsonl"))
    j = json_output("audit", rep)
    got = _flagged(j)
    # the identity statistics see none of them; two shifted files' low slots hold embed rows, which
    # depend on the token alone, so the stale check may see one repeat the other's (a finding)
    assert not {f["kind"] for fs in got.values() for f in fs} - {"stale"}, got
    assert not [n for n, fault in flat_set.faults.items() if fault == "off_by_one" and n in got]
    assert not rep.ok and set(AUX) <= set(rep.undecided) and j["exact"]["undecided_files"] == rep.files
    assert rep.exit_code == (3 if got else UNDECIDED)  # a finding wins, and the headline still says undecided
    assert "identity undecided for most files of" in j["headline"] and "off by one" in j["headline"]


def test_escalation_finds_and_names_shifted_and_off_by_one_labels(flat_set, flat_target, tmp_path):
    """The default budget: every undecided file of a small target identified exactly."""
    res = _cli(flat_set.root, "--spec", flat_set.spec, "--reference", f"hf:{flat_target}", "--workers", "1",
               "--state", tmp_path / "s.jsonl", "--json", code=3)
    j = json.loads(res.stdout)
    assert j["verdict"] == "flagged" and j["undecided"] == [] and j["cannot_see"] == []
    got = _flagged(j)
    assert set(got) == set(flat_set.faults), (sorted(got), flat_set.faults)
    for name, fault in flat_set.faults.items():
        low = [f for f in got[name] if f["kind"] == "exact" and f["slot"] == "low"]
        assert len(low) == 1 and f"identified on its own tokens as {TRUE_LOW[fault]}" in low[0]["detail"], got[name]
    assert list(got) == sorted(got, key=lambda n: int(n.split("_")[1].split(".")[0]))  # in file order
    ex = j["exact"]
    assert ex["budget"] is None and ex["params"] == parameters(flat_target) > 0
    assert ex["escalated"] == ex["undecided_files"] == ex["files"] == j["files"] and ex["found"] == 4
    for s in j["slots"]:
        assert s["undecided"] == 0 and sum(s["exact_verdicts"].values()) == j["files"]
    low = next(s for s in j["slots"] if s["name"] == "low")
    assert low["exact_verdicts"]["mismatch"] == 4 and low["exact"]["embed"] == 2 and low["exact"]["layer_out[1]"] == 2
    assert any(n.startswith("exact identification (auto") and "a small target" in n for n in j["notes"]), j["notes"]


def test_an_explicit_budget_is_kept_and_zero_disables(flat_set, flat_target, tmp_path):
    ref = f"hf:{flat_target}"
    rep = run_audit(Plan(flat_set.root, str(flat_set.spec), reference=ref, exact_files=5, workers=1,
                         state_path=tmp_path / "five.jsonl"))
    j = json_output("audit", rep)
    assert j["exact"]["files"] == j["exact"]["escalated"] == 5 and j["exact"]["spot_checked"] == 0
    assert set(AUX) <= set(j["undecided"])  # 5 of 40 files decided: most are not
    assert rep.exit_code == (3 if rep.agg.flagged else UNDECIDED)


def test_a_resumed_audit_keeps_the_exact_results_and_runs_none_again(flat_set, flat_target, tmp_path):
    plan = dict(reference=f"hf:{flat_target}", workers=1, state_path=tmp_path / "s.jsonl")
    first = run_audit(Plan(flat_set.root, str(flat_set.spec), **plan))
    again = run_audit(Plan(flat_set.root, str(flat_set.spec), resume=True, **plan))
    assert first.exact_run is not None and again.exact_run is not None
    assert first.exact_run.ran == first.files and again.exact_run.ran == 0 and again.resumed == again.files
    keep = ("outliers", "findings", "flagged", "undecided", "verdict", "headline")
    j_again, j_first = json_output("audit", again), json_output("audit", first)
    assert {k: j_again[k] for k in keep} == {k: j_first[k] for k in keep}
    assert [s["exact_verdicts"] for s in j_again["slots"]] == [s["exact_verdicts"] for s in j_first["slots"]]


def test_a_separable_target_stays_exit_0_with_its_counts_shown(dump_set, tiny_target, tmp_path):
    root = _clean(dump_set, tmp_path / "clean")
    page = tmp_path / "r.html"
    res = _cli(root, "--spec", dump_set.spec, "--reference", f"hf:{tiny_target}", "--report", page,
               "--state", tmp_path / "s.jsonl", code=0)
    lines = res.stdout.splitlines()
    n = len(list(root.iterdir()))
    assert lines[0].startswith("ok: every file is what the spec declares"), lines[0]
    assert "every file is what the spec declares" in lines[-5]
    for name in ("low", "mid", "high", "last"):
        line = next(x for x in lines if x.strip().startswith(f"{name} identity:"))
        assert f"ok {n}, mismatch 0, no_match 0, unresolved 0, not_run 0" in line and f"undecided 0 of {n}" in line
    html = page.read_text()
    assert "<b>OK</b>" in html and "Identity per slot" in html and html.count("<td>low</td>") == 1


def test_no_reference_is_undecided_too(dump_set, tmp_path):
    root = _clean(dump_set, tmp_path / "clean")
    rep = run_audit(Plan(root, str(dump_set.spec), workers=1, state_path=tmp_path / "s.jsonl"))
    j = json_output("audit", rep)
    assert rep.exit_code == UNDECIDED and j["verdict"] == "undecided" and len(j["undecided"]) == 4
    assert "no --reference" in j["headline"] and all(s["verdicts"]["not_run"] == s["files"] for s in j["slots"])
    only = run_audit(Plan(root, str(dump_set.spec), structure_only=True, state_path=tmp_path / "t.jsonl"))
    assert only.exit_code == 0 and json_output("audit", only)["headline"].startswith("ok: every file's structure")


def test_the_html_histogram_says_how_many_points_it_leaves_out(flat_set, flat_target, tmp_path, monkeypatch):
    import surgeon.audit.html as page
    from surgeon.audit.html import write_report

    monkeypatch.setattr(page, "BARS", BARS := 3)  # the plot's 8 bars hold all of these few points: fewer shown
    root = _clean(flat_set, tmp_path / "clean")
    rep = run_audit(Plan(root, str(flat_set.spec), reference=f"hf:{flat_target}", exact_files=0, workers=1,
                         state_path=tmp_path / "s.jsonl"))
    html = write_report(rep, tmp_path / "r.html").read_text()
    assert "<b>UNDECIDED</b>" in html and "cannot see" in html
    many = [s for s in json_output("audit", rep)["slots"] if len(s["identity"]) > BARS]
    assert many, "no slot with more points than the plot shows: the test shows nothing"
    for s in many:
        assert f"+{len(s['identity']) - BARS} more" in html


# -- the budget, without a model ------------------------------------------------------------------
@pytest.mark.parametrize("params, want, small", [
    (1_000_000, 100, True),  # 1e6 x 100 files x 1000 tokens = 1e11: all of them
    (10_000_000, 50, False),  # 1e12 > the budget: the 50 evenly spaced files that fit 5e11
    (10**9, 0, False),  # one file costs 1e12: none fits
])
def test_the_automatic_budget_is_parameters_times_tokens(monkeypatch, params, want, small):
    monkeypatch.setattr(exact_mod, "parameters", lambda model: params)
    run = ExactRun("model", None)
    undecided = [(2 * i, 1000) for i in range(100)]  # every other file of 200
    select(run, 200, undecided)
    assert len(run.escalated) == want and run.small is small and run.param_tokens <= max(PARAM_TOKENS, 1e11)
    assert set(run.escalated) <= {i for i, _ in undecided} and len(run.spot) == SPOT
    assert not set(run.spot) & set(run.escalated)
    if 0 < want < 100:  # evenly spaced: from the start of the set to its end, not its first files
        assert min(run.escalated) < 10 and max(run.escalated) > 180


def test_an_explicit_budget_takes_the_undecided_first_then_spot_checks(monkeypatch):
    monkeypatch.setattr(exact_mod, "parameters", lambda model: 1)
    run = ExactRun("model", 6)
    select(run, 100, [(10, 5), (20, 5), (30, 5), (40, 5)])
    assert run.escalated == [10, 20, 30, 40] and len(run.spot) == 2
    none = ExactRun("model", 0)
    select(none, 100, [(10, 5)])
    assert none.escalated == [] and none.spot == [] and none.undecided == 1
    assert ExactRun(None, None).rule.startswith("none")


def test_open_slots_are_the_undecided_declared_ones_without_a_finding_of_their_own():
    r = {"slots": [{"name": "a", "declared": "embed", "identity": {"verdict": "unresolved"}},
                   {"name": "b", "declared": "layer_out[0]", "identity": {"verdict": "not_run"}},
                   {"name": "c", "declared": "layer_out[1]", "identity": {"verdict": "not_run"}},
                   {"name": "d", "declared": None, "identity": {"verdict": "not_run"}},
                   {"name": "e", "declared": "layer_out[2]", "identity": {"verdict": "ok"}}],
         "findings": [{"kind": "zero", "slot": "c", "detail": ""}]}
    assert open_slots(r) == ["a", "b"]
