"""The structure pass's own reader of a ``torch.save`` zip's pickle: what it builds is what
``torch.load(map_location="meta", weights_only=True)`` builds, and whatever it does not take it
leaves to that loader, without running one function the file names."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from surgeon.audit.structure import read_structure
from surgeon.audit.torchzip import meta_load
from surgeon.capture.tensorfiles import open_tensor_file
from surgeon.core.errors import BadInput

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


def _same(got, want) -> None:
    assert type(got) is type(want) or (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor))
    if isinstance(want, torch.Tensor):
        assert got.is_meta and want.is_meta
        assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == \
               (want.dtype, want.shape, want.stride(), want.storage_offset())
        gs, ws = got.untyped_storage(), want.untyped_storage()
        assert gs.nbytes() == ws.nbytes() and gs._checkpoint_offset == ws._checkpoint_offset
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    else:
        assert got == want


@st.composite
def _samples(draw):
    """A dict as a training sample writer might save: tensors of any dtype, shape and view (a slice,
    a transpose, two entries on one storage), and a few plain values."""
    out: dict = {}
    bases = []
    for i in range(draw(st.integers(1, 5))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
        t = torch.zeros(shape, dtype=dtype) if dtype == torch.bool else torch.arange(
            int(torch.tensor(shape).prod()) if shape else 1).reshape(shape).to(dtype)
        view = draw(st.sampled_from(["whole", "slice", "transpose", "shared"]))
        if view == "slice" and t.dim() and t.shape[0] > 1:
            t = t[1:]
        elif view == "transpose" and t.dim() >= 2:
            t = t.transpose(0, 1)
        elif view == "shared" and bases:
            t = bases[-1].reshape(-1)[: max(0, bases[-1].numel() - 1)]
        bases.append(t)
        out[f"t{i}"] = t
    out.update(draw(st.dictionaries(st.sampled_from(["n", "name", "ids"]),
                                    st.one_of(st.integers(-5, 5), st.text(max_size=4), st.none(),
                                              st.lists(st.integers(0, 9), max_size=3)), max_size=2)))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_samples())
def test_it_builds_what_torch_load_builds_on_the_meta_device(tmp_path, data):
    path = tmp_path / "s.ckpt"
    torch.save(data, path)
    got = meta_load(open_tensor_file(path))
    want = torch.load(path, map_location="meta", weights_only=True)
    assert got is not None and set(got) == set(want)
    for k in want:
        _same(got[k], want[k])


def _zip_with_pickle(path: Path, payload: bytes) -> Path:
    """A torch.save zip whose data.pkl is ``payload``."""
    torch.save({"x": torch.ones(2)}, path)
    src = zipfile.ZipFile(path).infolist()
    blobs = {i.filename: zipfile.ZipFile(path).read(i.filename) for i in src}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, raw in blobs.items():
            z.writestr(name, payload if name.endswith("/data.pkl") else raw)
    return path


class _System:
    """Pickles as a call of os.system: what a hostile sample would hold."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        import os

        return os.system, (self.cmd,)


def test_a_pickle_that_names_another_function_runs_nothing_and_gets_torch_loads_verdict(tmp_path):
    marker = tmp_path / "ran"
    path = _zip_with_pickle(tmp_path / "evil.ckpt", pickle.dumps({"x": _System(f"touch {marker}")}, protocol=2))
    assert meta_load(open_tensor_file(path)) is None
    with pytest.raises(BadInput, match="cannot be read with weights_only=True"):
        read_structure(path)
    assert not marker.exists()


@pytest.mark.parametrize("value", [torch.nn.Parameter(torch.ones(3)), torch.ones(3).requires_grad_()],
                         ids=["parameter", "requires_grad"])
def test_what_it_does_not_build_is_left_to_torch_load(tmp_path, value):
    path = tmp_path / "p.ckpt"
    torch.save({"aux_hidden_state": value}, path)
    assert meta_load(open_tensor_file(path)) is None
    st_ = read_structure(path)  # torch.load read it
    assert st_.layout == "specforge" and "no hidden_state tensor" in st_.findings


@pytest.mark.parametrize("payload", [pickle.dumps([1, 2], protocol=2), pickle.dumps({1: 2}, protocol=2), b"\x80\x02}",
                                     b"not a pickle"], ids=["list", "int_keys", "truncated", "garbage"])
def test_a_top_level_it_does_not_take_is_none(tmp_path, payload):
    assert meta_load(open_tensor_file(_zip_with_pickle(tmp_path / "odd.ckpt", payload))) is None


def test_a_storage_that_is_no_record_of_the_zip_is_none(tmp_path):
    buf = io.BytesIO()
    torch.save({"x": torch.ones(2)}, buf)
    path = tmp_path / "s.ckpt"
    path.write_bytes(buf.getvalue())
    blobs = {i.filename: zipfile.ZipFile(path).read(i.filename) for i in zipfile.ZipFile(path).infolist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, raw in blobs.items():
            if "/data/" not in name:  # the storage's record left out
                z.writestr(name, raw)
    assert meta_load(open_tensor_file(path)) is None
