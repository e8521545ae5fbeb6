"""The value pass's chunked read: the rows each layout's header locates, read in chunks of any size,
give exactly what the tensors give (norms, hashed columns, sampled rows, row 0, and every value
finding); a file the header does not describe densely is read through its tensors; a file cut
short after its header was read is bad input, not a crash."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
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
    """(from the row plan, through the tensors): what each read of ``path`` gathers, and its ids."""
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
            assert [dataclasses.asdict(v) for v in va] == [dataclasses.asdict(v) for v in vb]
            assert (ha == hb).all() and (sa.count == sb.count).all()
            assert np.array_equal(sa.sum, sb.sum, equal_nan=True) and np.array_equal(sa.sumsq, sb.sumsq, equal_nan=True)


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
       chunk=st.integers(1, 40_000), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
def test_any_chunk_size_any_shape_gives_the_tensors_answer(tmp_path_factory, T, H, n, seed, chunk, dtype):
    path = tmp_path_factory.mktemp("hs") / "hs_0.safetensors"
    hs = _speculators(path, T, H, n, seed, dtype)
    s = read_structure(path)
    assert s.rows is not None and s.rows.regions[0].row_bytes == n * H * hs.element_size()
    a = gather_file(s.rows, chunk)
    from surgeon.audit.values import gather_tensors

    b = gather_tensors([hs[:, i] for i in range(n)])
    assert_same_gather(a, b)
    names = [f"s{i}" for i in range(n)]
    va, ha, _ = gathered_values(names, [None] * n, a)
    vb, hb, _ = gathered_values(names, [None] * n, b)
    assert [dataclasses.asdict(v) for v in va] == [dataclasses.asdict(v) for v in vb]
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

    os.unlink(path)  # gone since its header was read: bad input too, not an OSError
    with pytest.raises(BadInput, match="cannot be read"):
        gather_file(s.rows)
    path.write_bytes(src.read_bytes()[:-1000])
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


def _specforge_sample(path, T=40, H=64, k=3):
    g = torch.Generator().manual_seed(0)
    data = {"aux_hidden_state": torch.randn(1, T, k * H, generator=g).bfloat16(),
            "hidden_state": torch.randn(1, T, H, generator=g).bfloat16(),
            "input_ids": torch.arange(T), "loss_mask": torch.ones(1, T, dtype=torch.long)}
    data["aux_hidden_state"][0, 5, :H] = float("nan")
    torch.save(data, path)
    return data


def _rezip(src, dst, compression, change=lambda name, data: data):
    """``src`` written again by Python's zipfile (another layout than torch's writer), each record
    through ``change``."""
    import zipfile

    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w", compression) as w:
        for info in z.infolist():
            w.writestr(info.filename, change(info.filename, z.read(info.filename)))


@pytest.mark.parametrize("how", ["stored", "deflated", "big-endian"])
def test_a_zip_another_writer_made_is_read_through_its_tensors_with_the_same_answer(tmp_path, how):
    """torch computes a zip's record offsets from its own writer's layout: another writer's stored
    zip loads but those offsets are wrong; the structure pass takes them from the zip's own local
    headers, and reads its rows in place. A compressed one cannot be read so, and a big-endian one
    crashed torch on the meta device: they get no row plan. Each gets the source's answer."""
    import zipfile

    import numpy as np

    from surgeon.audit.worker import Context
    from tests.conftest import tiny_spec

    src = tmp_path / "data_src.ckpt"
    data = _specforge_sample(src)
    widths = {t.untyped_storage().nbytes(): t.element_size() for t in data.values()}

    def swap(name, raw):
        if name.endswith("/byteorder"):
            return b"big"
        if "/data/" in name:
            return np.frombuffer(raw, {2: np.uint16, 8: np.uint64}[widths[len(raw)]]).byteswap().tobytes()
        return raw

    dst = tmp_path / "data_0.ckpt"
    _rezip(src, dst, zipfile.ZIP_DEFLATED if how == "deflated" else zipfile.ZIP_STORED,
           swap if how == "big-endian" else (lambda name, raw: raw))
    loaded = torch.load(dst, weights_only=True)
    assert all(torch.equal(loaded[k], data[k]) for k in ("hidden_state", "input_ids"))
    assert read_structure(src).rows is not None
    assert (read_structure(dst).rows is not None) == (how == "stored")
    ctx = Context(str(tiny_spec(tmp_path)))
    got, want = audit_file(ctx, str(dst)), audit_file(ctx, str(src))
    assert got["slots"] == want["slots"] and got["hashes"] == want["hashes"] and got["findings"] == want["findings"]
    assert got["slots"][0]["nonfinite_rows"] == 1


def test_the_ids_are_read_subjects_when_a_file_holds_both_names(tmp_path):
    from tests.conftest import tiny_spec

    path = tmp_path / "hs_0.safetensors"
    save_file({"hidden_states": torch.randn(20, 3, 64), "input_ids": torch.arange(100, 120),
               "token_ids": torch.arange(20)}, str(path))
    a, b = both_ways(path, load_spec(tiny_spec(tmp_path)))
    assert_same_gather(a, b)
    from surgeon.audit.rows import read_ids

    assert read_ids(read_structure(path).rows).tolist() == list(range(100, 120))


def test_malformed_samples_are_findings_not_crashes(tmp_path):
    from surgeon.audit.worker import Context
    from tests.conftest import tiny_spec

    ctx = Context(str(tiny_spec(tmp_path)))
    save_file({"hidden_states": torch.zeros(4, 0, 64), "input_ids": torch.arange(4)}, str(tmp_path / "hs_n0.safetensors"))
    torch.save({"aux_hidden_state": torch.zeros(192), "hidden_state": torch.zeros(1, 4, 64),
                "input_ids": torch.arange(4), "loss_mask": torch.ones(4)}, tmp_path / "data_1d.ckpt")
    for name in ("hs_n0.safetensors", "data_1d.ckpt"):
        out = audit_file(ctx, str(tmp_path / name))
        assert "unreadable" in {f["kind"] for f in out["findings"]}, out["findings"]


def test_a_row_wider_than_the_buffer_is_read_and_its_memory_not_kept(tmp_path):
    import surgeon.audit.rows as rows

    path = tmp_path / "hs_0.safetensors"
    H = rows.CHUNK_BYTES // 2 + 8  # one row of float16 is wider than the buffer
    hs = torch.randn(2, 1, H).half()
    save_file({"hidden_states": hs, "input_ids": torch.arange(2)}, str(path))
    g = gather_file(read_structure(path).rows)
    assert torch.equal(g.first[0], hs[0, 0].float())
    assert rows._BUFFER and rows._BUFFER[0].numel() == rows.CHUNK_BYTES

