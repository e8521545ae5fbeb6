"""The audit at the edges of its input: a sample no writer should have made is a finding on that file
and the audit goes on; values a float32 norm cannot tell apart are told apart; a buffer written at
every position of a slot is found; the ``hf:`` profile is built from prompts spread over the set, and
a sample of any length is judged against the profile of its length (the ladder)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from surgeon.audit.pipeline import Plan, run_audit
from surgeon.audit.synthetic import make_synthetic_set, spec_text
from surgeon.audit.worker import Context, audit_file
from surgeon.commands.outputs import json_output
from surgeon.core.points import FINAL_NORM, layer_out

H, T = 16, 6


def _spec(tmp_path: Path, layout: str, hidden: int = H) -> str:
    p = tmp_path / f"spec_{layout}.yaml"
    p.write_text(spec_text(layout, 8, hidden))
    return str(p)


def _specforge(path: Path, slots: list, ids=None) -> Path:
    ids = torch.arange(slots[0].shape[0]) if ids is None else ids
    torch.save({"input_ids": ids[None], "loss_mask": torch.ones(1, slots[0].shape[0]),
                "aux_hidden_state": torch.cat(slots[:-1], -1)[None], "hidden_state": slots[-1][None]}, path)
    return path


def _speculators(path: Path, slots: list, ids=None) -> Path:
    ids = torch.arange(slots[0].shape[0]) if ids is None else ids
    save_file({"token_ids": ids, "hidden_states": torch.stack(slots, 1).contiguous()}, str(path))
    return path


def _slots(n: int = T, hidden: int = H, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=g) * (i + 1) for i in range(4)]


def _kinds(out: dict) -> list[tuple[str, str | None]]:
    return [(f["kind"], f["slot"]) for f in out["findings"]]


_aux, _hidden = torch.randn(1, T, 3 * H), torch.randn(1, T, H)
_ids, _mask = torch.arange(T)[None], torch.ones(1, T)
MALFORMED = {
    "no_hidden_state": (dict(input_ids=_ids, loss_mask=_mask, aux_hidden_state=_aux), "no hidden_state tensor"),
    "hidden_state_none": (dict(input_ids=_ids, loss_mask=_mask, aux_hidden_state=_aux, hidden_state=None),
                          "no hidden_state tensor"),
    "loss_mask_list": (dict(input_ids=_ids, loss_mask=[1] * T, aux_hidden_state=_aux, hidden_state=_hidden),
                       "loss_mask is a list, not a tensor"),
    "input_ids_none": (dict(input_ids=None, loss_mask=_mask, aux_hidden_state=_aux, hidden_state=_hidden),
                       "input_ids is a NoneType, not a tensor"),
    "aux_0d": (dict(input_ids=_ids, loss_mask=_mask, aux_hidden_state=torch.tensor(1.0), hidden_state=_hidden),
               "no [tokens, k x hidden] slots"),
    "aux_width_0": (dict(input_ids=_ids, loss_mask=_mask, aux_hidden_state=torch.randn(1, T, 0), hidden_state=_hidden),
                    "no [tokens, k x hidden] slots"),
    "fp8": (dict(input_ids=_ids, loss_mask=_mask, aux_hidden_state=_aux.to(torch.float8_e4m3fn),
                 hidden_state=_hidden.to(torch.float8_e4m3fn)), "values not checked: slots of dtype float8_e4m3fn"),
    "int_hidden": (dict(input_ids=_ids, loss_mask=_mask, aux_hidden_state=_aux, hidden_state=_hidden.long()),
                   "values not checked: slots of dtype int64"),
    "short_ids": (dict(input_ids=_ids[:, :4], loss_mask=_mask, aux_hidden_state=_aux, hidden_state=_hidden),
                  "input_ids has shape [1, 4] for 6 tokens"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_specforge_sample_is_a_finding_on_it(tmp_path, name):
    data, needle = MALFORMED[name]
    torch.save(data, tmp_path / "data_0.ckpt")
    out = audit_file(Context(_spec(tmp_path, "specforge")), str(tmp_path / "data_0.ckpt"))
    details = [f["detail"] for f in out["findings"]]
    assert any(needle in d for d in details), details
    assert not any("not audited" in d for d in details), details  # foreseen: no fallback finding


@pytest.mark.parametrize("dtype, needle", [(torch.float8_e4m3fn, "F8_E4M3"), (torch.int64, "I64")])
def test_speculators_slots_of_no_float_dtype_are_not_read_as_values(tmp_path, dtype, needle):
    save_file({"token_ids": torch.arange(T), "hidden_states": torch.randn(T, 4, H).to(dtype)}, str(tmp_path / "hs_0.safetensors"))
    out = audit_file(Context(_spec(tmp_path, "speculators")), str(tmp_path / "hs_0.safetensors"))
    assert [f["detail"] for f in out["findings"]] == [f"values not checked: slots of dtype {needle} (the value pass reads "
                                                      "float16, bfloat16, float32, float64)"]


def test_the_audit_goes_on_past_a_malformed_sample_and_past_a_failure_no_check_foresaw(tmp_path, monkeypatch):
    import surgeon.audit.worker as worker

    root = tmp_path / "set"
    root.mkdir()
    for i in range(3):
        _specforge(root / f"data_{i}.ckpt", _slots(seed=i))
    torch.save(MALFORMED["short_ids"][0], root / "data_3.ckpt")
    rep = run_audit(Plan(root, _spec(tmp_path, "specforge"), workers=1, state_path=tmp_path / "s.jsonl"))
    assert rep.exit_code == 3 and [Path(o["path"]).name for o in json_output("audit", rep)["outliers"]] == ["data_3.ckpt"]

    def broken(*a, **k):
        raise RuntimeError("a case nobody foresaw\nsecond line")

    monkeypatch.setattr(worker, "_value_part", broken)
    out = audit_file(Context(_spec(tmp_path, "specforge")), str(root / "data_0.ckpt"))
    assert out["findings"] == [{"kind": "error", "slot": None, "detail": "not audited: RuntimeError: a case nobody foresaw"}]
    # every file audited and reported all the same; exit 1 (an internal error), and none recorded as
    # done: --resume audits them again
    rep = run_audit(Plan(root, _spec(tmp_path, "specforge"), workers=1, state_path=tmp_path / "e.jsonl"))
    assert rep.exit_code == 1 and rep.agg.kinds["error"] == 4 and any("4 file(s) not audited" in n for n in rep.notes)
    monkeypatch.undo()
    again = run_audit(Plan(root, _spec(tmp_path, "specforge"), workers=1, state_path=tmp_path / "e.jsonl", resume=True))
    assert again.resumed == 0 and again.exit_code == 3 and "error" not in again.agg.kinds


def test_rows_too_small_for_a_float32_norm_are_not_zero_rows(tmp_path):
    slots = [x.bfloat16() for x in _slots()]
    slots[0][1] = torch.randn(H).bfloat16() * 1e-25  # squares underflow float32: the norm would be 0
    slots[1][2] = 1e-39  # a subnormal repeated: a constant row, not a zero one
    slots[2][3] = 0.0
    for write, name in ((_specforge, "data_0.ckpt"), (_speculators, "hs_0.safetensors")):
        path = write(tmp_path / name, slots)
        layout = "specforge" if name.endswith(".ckpt") else "speculators"
        out = audit_file(Context(_spec(tmp_path, layout)), str(path))
        by_slot = {s["name"]: s for s in out["slots"]}
        assert [(f["kind"], f["slot"]) for f in out["findings"]] == [("constant", "mid"), ("zero", "high")], out["findings"]
        assert by_slot["low"]["zero_rows"] == 0 and by_slot["low"]["norm_min"] > 0
        assert by_slot["mid"]["constant_rows"] == 1 and by_slot["mid"]["zero_rows"] == 0


@pytest.mark.parametrize("write, layout, name", [(_specforge, "specforge", "data_0.ckpt"),
                                                 (_speculators, "speculators", "hs_0.safetensors")])
def test_one_row_written_at_every_position_of_a_slot_is_found(tmp_path, write, layout, name):
    slots = _slots(n=64)
    slots[1] = slots[1][40].expand(64, H).clone()  # 'mid', a layer's state: one row at all 64 positions
    ids = torch.randint(2, 300, (64,), generator=torch.Generator().manual_seed(1))
    out = audit_file(Context(_spec(tmp_path, layout)), str(write(tmp_path / name, slots, ids)))
    assert _kinds(out) == [("repeated", "mid")]
    assert out["findings"][0]["detail"].startswith("64 of its rows repeat")


def test_rows_repeated_on_their_own_token_are_no_finding(tmp_path):
    from surgeon.audit.values import repeated_within_slots
    from surgeon.core.points import EMBED, layer_out

    hashes = torch.randint(1, 2**62, (2, 6)).numpy()
    ids = torch.tensor([5, 7, 5, 9, 5, 7])
    hashes[:, 2] = hashes[:, 0]  # position 2 repeats position 0: the same token, 5
    assert repeated_within_slots(["e", "x"], [EMBED, layer_out(1)], hashes, ids) == []
    hashes[0, 3] = hashes[0, 0]  # an embed row on another token: an embedding may repeat (untrained rows)
    assert repeated_within_slots(["e", "x"], [EMBED, layer_out(1)], hashes, ids) == []
    hashes[1, 3] = hashes[1, 0]  # a layer's state on another token: a broadcast
    found = repeated_within_slots(["e", "x"], [EMBED, layer_out(1)], hashes, ids)
    assert [(s, d.split(" of ")[0]) for s, d in found] == [("x", "repeated: 3")]  # positions 0, 2 and 3: one row
    assert repeated_within_slots(["e", "x"], [EMBED, layer_out(1)], hashes, None) == []  # no ids: no context


@pytest.mark.slow
def test_the_profile_is_built_across_the_set_and_judges_short_samples_by_their_rows(tiny_target, tmp_path):
    """A set sorted so that its first files are short (8 tokens), the rest long (128): the profile
    takes prompts from across the set, both lengths; neither kind of clean file is flagged (the
    first files alone made every long one "mismatch")."""
    short = make_synthetic_set(tmp_path / "a", tiny_target, files=12, layout="speculators", count=0, seed=6,
                               dtype="float32", lengths=(8,))
    long = make_synthetic_set(tmp_path / "b", tiny_target, files=20, layout="speculators", count=0, seed=7,
                              dtype="float32", lengths=(128,))
    root = tmp_path / "set"
    root.mkdir()
    for prefix, s in (("a_", short), ("b_", long)):
        for p in s.root.glob("*.safetensors"):
            shutil.copy(p, root / (prefix + p.name))
    rep = run_audit(Plan(root, str(short.spec), reference=f"hf:{tiny_target}", exact_files=0,
                         state_path=tmp_path / "s.jsonl"))
    assert rep.ok, [(Path(o["path"]).name, o["findings"][:1]) for o in json_output("audit", rep)["outliers"]]
    assert any("12 files spread over the set (8-128 tokens)" in n for n in rep.notes), rep.notes


@pytest.mark.slow
def test_samples_of_8_to_1024_tokens_are_each_judged_at_their_length(tiny_target, tmp_path):
    """Clean samples of 8 to 1024 tokens, and seeded faults among them: judged against one profile of
    whole prompts, 3 of the clean long ones were flagged (their statistics lie past the prompts' mix
    of lengths); the ladder judges each against prefixes of its own length: none flagged, every
    fault found, at every length."""
    s = make_synthetic_set(tmp_path / "s", tiny_target, files=160, layout="speculators", count=2, seed=3,
                           lengths=(8, 16, 32, 64, 128, 256, 512, 1024))
    rep = run_audit(Plan(s.root, str(s.spec), reference=f"hf:{tiny_target}", exact_files=0,
                         state_path=tmp_path / "s.jsonl"))
    flagged = {Path(o["path"]).name: {f["kind"] for f in o["findings"]} for o in json_output("audit", rep)["outliers"]}
    kinds = {"shifted": "identity", "off_by_one": "identity", "nan": "nonfinite", "zero": "zero", "stale": "stale"}
    assert {n: k for n, k in flagged.items() if n not in s.faults} == {}
    assert all(kinds[f] in flagged.get(n, set()) for n, f in s.faults.items()), (s.faults, flagged)
    assert rep.profile is not None and [n for n, _ in rep.profile.ladder][-1] >= 512


def test_the_prompts_are_the_longest_file_of_each_run_of_the_set(tmp_path, monkeypatch):
    """12 runs of the candidates in the set's order, the longest of each (the first of equals), then
    the others longest first; a set of fewer files than prompts gives each of its files."""
    from surgeon.audit import reference

    lengths = [5, 9, 9, 2, 30, 7, 1, 8, 3, 3, 60, 4] * 3
    files = [(f"f{i:02d}", t) for i, t in enumerate(lengths)]
    monkeypatch.setattr(reference, "_with_ids", lambda paths: [f for f in files if f[0] in paths])
    got = list(reference.prompt_files([f for f, _ in files]))
    # runs of 3: (5, 9, 9) gives its first 9, (2, 30, 7) its 30, (1, 8, 3) its 8, (3, 60, 4) its 60
    assert got[:12] == ["f01", "f04", "f07", "f10", "f13", "f16", "f19", "f22", "f25", "f28", "f31", "f34"]
    assert sorted(got) == sorted(f for f, _ in files)  # every candidate, once
    rest = got[12:]
    assert [dict(files)[f] for f in rest] == sorted((dict(files)[f] for f in rest), reverse=True)
    assert list(reference.prompt_files([f for f, _ in files[:5]])) == ["f00", "f01", "f02", "f03", "f04"]
    assert list(reference.prompt_files([], prefer=["a", "b"])) == ["a", "b"]


@pytest.mark.slow
def test_a_file_the_target_cannot_run_is_left_out_of_the_profile_and_named(tiny_target, tmp_path):
    s = make_synthetic_set(tmp_path / "s", tiny_target, files=14, layout="speculators", count=0, seed=1,
                           dtype="float32", lengths=(64,))
    bad = sorted(s.root.glob("hs_*.safetensors"))[3]
    t = load_file(str(bad))
    t["token_ids"] = t["token_ids"].clone()
    t["token_ids"][1] = 100000  # out of the target's vocabulary
    save_file(t, str(bad))
    rep = run_audit(Plan(s.root, str(s.spec), reference=f"hf:{tiny_target}", exact_files=0,
                         state_path=tmp_path / "s.jsonl"))
    assert any("1 file(s) left out" in n and bad.name in n for n in rep.notes), rep.notes
    assert any("12 files spread over the set" in n for n in rep.notes), rep.notes


def test_a_model_the_audit_cannot_use_stops_the_profile_at_its_first_file(specforge_set, monkeypatch):
    import surgeon.verify.reference as reference
    from surgeon.core.errors import BadInput

    calls = []

    def unusable(model_dir, ids, **kw):
        calls.append(model_dir)
        raise BadInput(f"{model_dir}: unrecognised model structure")

    monkeypatch.setattr(reference, "capture_reference", unusable)
    with pytest.raises(BadInput, match="unrecognised model structure"):
        run_audit(Plan(specforge_set.root, str(specforge_set.spec), reference=f"hf:{specforge_set.model}", exact_files=0,
                       state_path=specforge_set.root.parent / "m.jsonl"))
    assert len(calls) == 1  # not once per candidate file


def _dump(path: Path, points: list, num_layers: int = 8, seed: int = 0) -> Path:
    from surgeon.capture.dumps import write_dump

    write_dump(path, list(zip(["low", "mid", "high", "last"], points, _slots(seed=seed))), input_ids=torch.arange(T),
               num_layers=num_layers)
    return path


def test_a_file_of_another_layout_than_the_specs_or_of_none_is_a_finding(tmp_path):
    """A speculators sample in a set the spec says is SpecForge's (its last slot is another point),
    and float tensors saved loose (no layout the audit reads: their values would go unchecked)."""
    sf = _spec(tmp_path, "specforge")
    out = audit_file(Context(sf), str(_speculators(tmp_path / "hs_0.safetensors", _slots())))
    assert [f["detail"] for f in out["findings"]] == ["a speculators sample, the spec's dumps.layout is specforge "
                                                      "(its slots mean other points)"]
    x = _slots()
    x[1][:] = float("nan")
    save_file({"token_ids": torch.arange(T), **{f"hidden_states_{i}": s for i, s in enumerate(x)}},
              str(tmp_path / "hs_1.safetensors"))
    out = audit_file(Context(_spec(tmp_path, "speculators")), str(tmp_path / "hs_1.safetensors"))
    assert out["layout"] == "plain" and [f["kind"] for f in out["findings"]] == ["structure"]
    assert "its values are not checked" in out["findings"][0]["detail"]
    assert audit_file(Context(sf), str(_specforge(tmp_path / "data_0.ckpt", _slots())))["findings"] == []
    unstated = tmp_path / "unstated.yaml"  # dumps: without a layout: the default states nothing of the set
    unstated.write_text(Path(sf).read_text().replace("layout: specforge, ", ""))
    assert "layout" not in unstated.read_text()
    assert audit_file(Context(str(unstated)), str(tmp_path / "hs_0.safetensors"))["findings"] == []


def test_a_dumps_declared_points_and_layer_count_are_checked_against_the_spec(tmp_path):
    spec = _spec(tmp_path, "surgeon")
    good = [layer_out(0), layer_out(2), layer_out(4), FINAL_NORM]
    assert audit_file(Context(spec), str(_dump(tmp_path / "dump_0.safetensors", good)))["findings"] == []
    moved = audit_file(Context(spec), str(_dump(tmp_path / "dump_1.safetensors", [layer_out(1), *good[1:]])))
    assert [f["detail"] for f in moved["findings"]] == ["slot low is layer_out[1] in its header, the spec declares "
                                                        "layer_out[0]"]
    other = audit_file(Context(spec), str(_dump(tmp_path / "dump_2.safetensors", good, num_layers=12)))
    assert [f["detail"] for f in other["findings"]] == ["a dump of a 12-layer target, the spec's has 8"]


def test_token_ids_of_no_integer_dtype_are_a_finding_in_every_layout(tmp_path):
    from safetensors import safe_open

    ids = torch.arange(T).float() + 0.5
    out = audit_file(Context(_spec(tmp_path, "specforge")), str(_specforge(tmp_path / "data_0.ckpt", _slots(), ids)))
    assert "input_ids are float32, not integers: no token ids" in [f["detail"] for f in out["findings"]]
    d = _dump(tmp_path / "dump_0.safetensors", [layer_out(0), layer_out(2), layer_out(4), FINAL_NORM])
    with safe_open(str(d), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["input_ids"] = ids
    save_file(tensors, str(d), metadata=meta)
    out = audit_file(Context(_spec(tmp_path, "surgeon")), str(d))
    assert "input_ids are float32, not integers: no token ids" in [f["detail"] for f in out["findings"]]
    for i, dt in enumerate((torch.int32, torch.uint8, torch.int64)):  # every integer dtype is ids
        p = _speculators(tmp_path / f"hs_{i}.safetensors", _slots(), torch.arange(T).to(dt))
        assert audit_file(Context(_spec(tmp_path, "speculators")), str(p))["findings"] == []


def test_linked_folders_are_walked_once_and_a_loop_of_links_ends(tmp_path):
    from surgeon.audit.structure import discover

    root, shard = tmp_path / "set", tmp_path / "shard_b"
    (root / "a").mkdir(parents=True)
    shard.mkdir()
    _speculators(root / "a" / "hs_0.safetensors", _slots())
    bad = _slots(seed=1)
    bad[2][:] = float("nan")
    _speculators(shard / "hs_1.safetensors", bad)
    (root / "b").symlink_to(shard, target_is_directory=True)
    (root / "b2").symlink_to(shard, target_is_directory=True)  # the same folder twice
    (shard / "up").symlink_to(root, target_is_directory=True)  # a loop
    (root / "loop").symlink_to(root / "loop")  # a link to itself: not a folder, not a tensor file
    (root / "up").symlink_to(tmp_path, target_is_directory=True)  # DIR's parent: beyond DIR
    (tmp_path / "other").mkdir()
    _speculators(tmp_path / "other" / "hs_9.safetensors", _slots())  # another set beside DIR
    assert [p.relative_to(root).as_posix() for p in discover(root)] == ["a/hs_0.safetensors", "b/hs_1.safetensors"]
    rep = run_audit(Plan(root, _spec(tmp_path, "speculators"), workers=1, state_path=tmp_path / "s.jsonl"))
    assert [Path(o["path"]).name for o in json_output("audit", rep)["outliers"]] == ["hs_1.safetensors"]


def test_a_norm_past_float32s_range_is_held_at_its_largest_not_infinite(tmp_path):
    x = _slots()
    x[1][2] = 3.0e38  # finite in float32 (and near bfloat16's largest): its row's norm is not
    out = audit_file(Context(_spec(tmp_path, "speculators")), str(_speculators(tmp_path / "hs_0.safetensors", x)))
    mid = out["slots"][1]
    assert mid["nonfinite_rows"] == 0 and mid["norm_max"] == torch.finfo(torch.float32).max
    assert all(math.isfinite(mid[k]) for k in ("norm_mean", "norm_std", "norm_max"))
    json.dumps(out, allow_nan=False)  # what the resume state writes: numbers, no Infinity or NaN


def test_a_file_the_system_failed_to_read_is_not_recorded_as_done(tmp_path, monkeypatch):
    """An I/O error (or permissions, a network file system) may pass: --resume reads the file again."""
    import errno
    import os

    root = tmp_path / "set"
    root.mkdir()
    _speculators(root / "hs_0.safetensors", _slots())
    x = _slots(seed=1)
    x[1][:] = float("nan")
    _speculators(root / "hs_1.safetensors", x)
    real = os.open

    def failing(path, *a, **k):
        if str(path).endswith("hs_1.safetensors"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real(path, *a, **k)

    plan = dict(workers=1, state_path=tmp_path / "s.jsonl")
    monkeypatch.setattr(os, "open", failing)
    first = run_audit(Plan(root, _spec(tmp_path, "speculators"), **plan))
    assert json_output("audit", first)["findings"] == {"unreadable": 1}
    monkeypatch.setattr(os, "open", real)
    again = run_audit(Plan(root, _spec(tmp_path, "speculators"), resume=True, **plan))
    assert again.resumed == 1 and json_output("audit", again)["findings"] == {"nonfinite": 1}


def test_files_are_audited_in_the_order_their_numbers_say(tmp_path):
    """speculators writes hs_9 then hs_10, unpadded: a stale copy of hs_9's states in hs_10 is found
    on hs_10 (the later file), not on the genuine hs_9."""
    from surgeon.audit.structure import discover

    root = tmp_path / "set"
    root.mkdir()
    for i in (1, 2, 9, 10, 11):
        _speculators(root / f"hs_{i}.safetensors", _slots(seed=i), torch.arange(T) + i)
    stale = _slots(seed=10)
    stale[1] = _slots(seed=9)[1]  # hs_9's mid slot, on hs_10's tokens
    _speculators(root / "hs_10.safetensors", stale, torch.arange(T) + 10)
    assert [p.name for p in discover(root)] == [f"hs_{i}.safetensors" for i in (1, 2, 9, 10, 11)]
    rep = run_audit(Plan(root, _spec(tmp_path, "speculators"), workers=1, state_path=tmp_path / "s.jsonl"))
    assert [(Path(o["path"]).name, [f["kind"] for f in o["findings"]]) for o in json_output("audit", rep)["outliers"]] \
        == [("hs_10.safetensors", ["stale"])]


def test_a_dir_given_through_a_link_guards_the_folders_above_it_as_given(tmp_path):
    """DIR given as T/lnk (a link to R/data) holding a link up to T: T is above DIR as given, so the
    set beside it (T/other) is not walked."""
    from surgeon.audit.structure import discover

    (tmp_path / "R" / "data").mkdir(parents=True)
    _speculators(tmp_path / "R" / "data" / "hs_0.safetensors", _slots())
    (tmp_path / "T" / "other").mkdir(parents=True)
    _speculators(tmp_path / "T" / "other" / "hs_9.safetensors", _slots())
    (tmp_path / "T" / "lnk").symlink_to(tmp_path / "R" / "data", target_is_directory=True)
    (tmp_path / "R" / "data" / "up").symlink_to(tmp_path / "T", target_is_directory=True)
    root = tmp_path / "T" / "lnk"
    assert [p.relative_to(root).as_posix() for p in discover(root)] == ["hs_0.safetensors"]
