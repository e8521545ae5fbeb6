"""The value pass's chunked read: the rows each layout's header locates, read in chunks of any size,
give exactly what the tensors give (norms, hashed columns, sampled rows, row 0, and every value
finding); a file the header does not describe densely is read through its tensors; a file cut
short after its header was read is bad input, not a crash."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from surgeon.audit.rows import Region, plan
from surgeon.audit.structure import read_structure
from surgeon.audit.values import gather_file, gathered_values
from surgeon.audit.worker import _gathered, audit_file
from surgeon.core.errors import BadInput
from surgeon.core.spec import load_spec


def assert_same_gather(a, b) -> None:
    for name in ("norms", "blocks", "samples", "first"):  # bit for bit, NaN where NaN
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0, equal_nan=True, msg=name)
    assert a.dtype == b.dtype


def both_ways(path, spec, chunk_bytes=None):
    """(chunked, through the tensors): what each read of ``path`` gathers, and its ids."""
    s = read_structure(path)
    assert s.rows is not None, path
    by_file = gather_file(s.rows, chunk_bytes)
    by_tensors, ids, count = _gathered(dataclasses.replace(s, rows=None), str(path), spec)
    assert count == s.rows.slots
    _, ids_file, _ = _gathered(s, str(path), spec)
    assert torch.equal(ids_file, ids.reshape(-1).to(torch.int64))
    return by_file, by_tensors


@pytest.mark.parametrize("layout", ["specforge_set", "speculators_set", "dump_set"])
def test_every_layout_chunked_gives_what_its_tensors_give(layout, request):
    synthetic = request.getfixturevalue(layout)
    spec = load_spec(synthetic.spec)
    faulty = sorted(synthetic.faults)[:3]  # NaN, zero and stale rows among them
    clean = sorted(p.name for p in synthetic.root.iterdir() if p.name not in synthetic.faults
                   and not p.name.startswith("."))[:2]
    for name in faulty + clean:
        for chunk in (None, 3000):  # the default, and a chunk shorter than some regions' rows
            a, b = both_ways(synthetic.root / name, spec, chunk)
            assert_same_gather(a, b)
            names = [f"s{i}" for i in range(a.norms.shape[0])]
            va, ha, sa = gathered_values(names, [None] * len(names), a)
            vb, hb, sb = gathered_values(names, [None] * len(names), b)
            assert [v.to_json() for v in va] == [v.to_json() for v in vb]
            assert (ha == hb).all() and (sa.good == sb.good).all()


def _speculators(path, T, H, n, seed, dtype=torch.bfloat16):
    """A speculators sample with a NaN row, an Inf value, a zero row and a constant row."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(T, n, H, generator=g).to(dtype)
    hs[min(3, T - 1), 0] = float("nan")
    hs[T // 2, n - 1, H // 3] = float("inf")
    hs[T - 1, 0] = 0
    hs[min(1, T - 1), n - 1] = 0.5
    save_file({"hidden_states": hs, "token_ids": torch.arange(T, dtype=torch.int64)}, str(path))
    return hs


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 70), H=st.integers(1, 150), n=st.integers(1, 4), seed=st.integers(0, 9),
       chunk=st.integers(1, 40_000), half=st.booleans())
def test_any_chunk_size_any_shape_gives_the_tensors_answer(tmp_path_factory, T, H, n, seed, chunk, half):
    path = tmp_path_factory.mktemp("hs") / "hs_0.safetensors"
    hs = _speculators(path, T, H, n, seed, torch.float16 if half else torch.bfloat16)
    s = read_structure(path)
    assert s.rows is not None and s.rows.regions[0].row_bytes == n * H * 2
    a = gather_file(s.rows, chunk)
    from surgeon.audit.values import gather_tensors

    b = gather_tensors([hs[:, i] for i in range(n)])
    assert_same_gather(a, b)
    names = [f"s{i}" for i in range(n)]
    va, ha, _ = gathered_values(names, [None] * n, a)
    vb, hb, _ = gathered_values(names, [None] * n, b)
    assert [v.to_json() for v in va] == [v.to_json() for v in vb]
    assert (ha == hb).all()
    if T >= 5:  # the seeded rows are distinct rows
        assert va[0].nonfinite_rows >= 1 and va[0].zero_rows == 1 and va[-1].constant_rows >= 1


def test_a_file_cut_short_after_its_header_was_read_is_an_unreadable_finding(speculators_set, tmp_path):
    src = sorted(speculators_set.root.glob("hs_*"))[0]
    path = tmp_path / src.name
    path.write_bytes(src.read_bytes())
    s = read_structure(path)
    os.truncate(path, os.path.getsize(path) - 1000)
    with pytest.raises(BadInput, match="truncated"):
        gather_file(s.rows)
    from surgeon.audit.worker import Context

    out = audit_file(Context(str(speculators_set.spec)), str(path))  # the gate sees it now
    assert [f["kind"] for f in out["findings"]] == ["unreadable"]


def test_a_specforge_sample_not_stored_densely_is_read_through_its_tensors(specforge_set, tmp_path):
    """A SpecForge dict whose aux states were saved as a transposed view (a storage in another
    order): no row plan; the value pass reads its tensors and finds the same values."""
    from surgeon.audit.worker import Context

    src = sorted(specforge_set.root.glob("data_*"))[0]
    data = torch.load(src, weights_only=True)
    path = tmp_path / "data_0.ckpt"
    aux = data["aux_hidden_state"]
    data["aux_hidden_state"] = aux[0].t().contiguous().t()[None]  # the same values, column-major
    torch.save(data, path)
    assert read_structure(path).rows is None and read_structure(src).rows is not None
    ctx = Context(str(specforge_set.spec))
    got, want = audit_file(ctx, str(path)), audit_file(ctx, str(src))
    assert got["slots"] == want["slots"] and got["hashes"] == want["hashes"]


def test_a_plan_refuses_what_it_cannot_read_densely():
    r = Region(100, 10, (0, 1), 8, "bfloat16")
    assert plan("f", [r], None, 100 + 10 * 32) is not None
    assert plan("f", [r], None, 100 + 10 * 32 - 1) is None  # past the end of the file
    assert plan("f", [Region(100, 10, (0, 2), 8, "bfloat16")], None, 10_000) is None  # slot 1 nowhere
    assert plan("f", [r, Region(500, 10, (1,), 8, "bfloat16")], None, 10_000) is None  # slot 1 twice
    assert plan("f", [r, Region(500, 10, (2,), 8, "float16")], None, 10_000) is None  # two dtypes
    assert plan("f", [r], (0, 9, "int64"), 10_000) is None  # 9 ids for 10 rows
    assert plan("f", [Region(0, 0, (0,), 8, "bfloat16")], None, 10_000) is None  # no rows
