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
from surgeon.audit.torchzip import TorchZip
from surgeon.capture.tensorfiles import open_tensor_file
from surgeon.core.errors import BadInput


def meta_load(path: Path):
    tz = TorchZip.open(open_tensor_file(path))
    return None if tz is None else tz.meta_load()


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
    got = meta_load(path)
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
    assert meta_load(path) is None
    with pytest.raises(BadInput, match="cannot be read with weights_only=True"):
        read_structure(path)
    assert not marker.exists()


@pytest.mark.parametrize("value", [torch.nn.Parameter(torch.ones(3)), torch.ones(3).requires_grad_()],
                         ids=["parameter", "requires_grad"])
def test_what_it_does_not_build_is_left_to_torch_load(tmp_path, value):
    path = tmp_path / "p.ckpt"
    torch.save({"aux_hidden_state": value}, path)
    assert meta_load(path) is None
    st_ = read_structure(path)  # torch.load read it
    assert st_.layout == "specforge" and "no hidden_state tensor" in st_.findings


@pytest.mark.parametrize("payload", [pickle.dumps([1, 2], protocol=2), pickle.dumps({1: 2}, protocol=2), b"\x80\x02}",
                                     b"not a pickle"], ids=["list", "int_keys", "truncated", "garbage"])
def test_a_top_level_it_does_not_take_is_none(tmp_path, payload):
    assert meta_load(_zip_with_pickle(tmp_path / "odd.ckpt", payload)) is None


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
    assert meta_load(path) is None


def _poisoned_twice(path: Path, rename) -> Path:
    """A SpecForge sample whose zip holds each storage twice: NaNs under ``rename(name)`` first
    (the entry torch's reader finds), the clean bytes under the name itself last (the one Python's
    zipfile keeps)."""
    import warnings

    T, H = 8, 16
    clean = {"input_ids": torch.arange(T)[None], "loss_mask": torch.ones(1, T),
             "aux_hidden_state": torch.randn(1, T, 3 * H), "hidden_state": torch.randn(1, T, H)}
    bad = {k: v.clone() for k, v in clean.items()}
    bad["aux_hidden_state"][:] = float("nan")
    cb, pb = io.BytesIO(), io.BytesIO()
    torch.save(clean, cb)
    torch.save(bad, pb)
    zc, zp = zipfile.ZipFile(cb), zipfile.ZipFile(pb)
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w") as w:
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name it is asked to write
        for name in zc.namelist():
            if "/data/" in name:
                w.writestr(rename(name), zp.read(name))
            w.writestr(name, zc.read(name))
    return path


@pytest.mark.parametrize("rename", [lambda n: n, lambda n: n.replace("/data/", "/DATA/"), lambda n: n + "\0x"],
                         ids=["twice", "case", "nul"])
def test_a_zip_whose_readers_disagree_on_a_record_is_unreadable_not_clean(tmp_path, rename):
    """torch.load reads the NaNs; reading the record Python's zipfile names would audit it clean."""
    from surgeon.audit.worker import Context, audit_file
    from tests.conftest import tiny_spec

    path = _poisoned_twice(tmp_path / "data_0.ckpt", rename)
    if rename("x") == "x":
        assert not torch.isfinite(torch.load(path, weights_only=True)["aux_hidden_state"]).all()
    with pytest.raises(BadInput, match="zip readers disagree"):
        open_tensor_file(path)
    out = audit_file(Context(str(tiny_spec(tmp_path))), str(path))
    assert [f["kind"] for f in out["findings"]] == ["unreadable"] and "disagree" in out["findings"][0]["detail"]


def _s(text: str) -> bytes:  # BINUNICODE
    return b"X" + len(text.encode()).to_bytes(4, "little") + text.encode()


def _i(n: int) -> bytes:  # BININT1 / BININT
    return b"K" + bytes([n]) if 0 <= n < 256 else b"J" + n.to_bytes(4, "little", signed=True)


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _tup(*xs: bytes) -> bytes:
    return b"(" + b"".join(xs) + b"t"


def _tensor(key: str, numel: int, storage_class: bytes | None = None, hooks: bytes | None = None) -> bytes:
    """A plain float32 tensor of ``numel`` elements, as torch.save pickles it (pieces replaceable)."""
    cls = storage_class if storage_class is not None else _global("torch", "FloatStorage")
    pid = _tup(_s("storage"), cls, _s(key), _s("cpu"), _i(numel)) + b"Q"
    hk = hooks if hooks is not None else _global("collections", "OrderedDict") + b")R"
    return _global("torch._utils", "_rebuild_tensor_v2") + _tup(pid, _i(0), _tup(_i(numel)), _tup(_i(1)), b"\x89", hk) + b"R"


def _dict(**items: bytes) -> bytes:
    return b"\x80\x02}(" + b"".join(_s(k) + v for k, v in items.items()) + b"u."


@pytest.mark.parametrize("payload", [
    _dict(x=_tensor("0", 4)),  # the control: what torch.save writes, built
    # BUILD (slot state) giving the storage class stand-in another dtype: torch.load refuses BUILD there
    _dict(x=_tensor("0", 4, _global("torch", "FloatStorage") + b"N}" + _s("dtype") + _s("int64") + b"s\x86b")),
    # OrderedDict called with an iterable of the file's choosing (a meta tensor of 2**26 rows: hours)
    _dict(x=_tensor("0", 4, hooks=_global("collections", "OrderedDict") + _tup(b"]") + b"R")),
    # one storage key with two sizes (torch.load on the CPU refuses the record's size)
    _dict(x=_tensor("0", 4), y=_tensor("0", 2)),
    # an item set on a list (the C unpickler sets it on any object; the weights-only loader refuses)
    _dict(x=_tensor("0", 4), y=b"](" + _i(5) + b"e" + _i(0) + _i(1) + b"s"),
], ids=["control", "build_dtype", "ordered_dict_args", "one_key_two_sizes", "setitem_on_a_list"])
def test_what_torch_save_does_not_write_is_left_to_torch_load(tmp_path, payload):
    got = meta_load(_zip_with_pickle(tmp_path / "p.ckpt", payload))
    assert (got is not None) == (payload == _dict(x=_tensor("0", 4)))


def test_a_torchscript_archive_is_left_to_torch_load(tmp_path):
    path = tmp_path / "ts.ckpt"
    torch.save({"x": torch.ones(2)}, path)
    blobs = {i.filename: zipfile.ZipFile(path).read(i.filename) for i in zipfile.ZipFile(path).infolist()}
    folder = next(n for n in blobs if n.endswith("/data.pkl"))[: -len("data.pkl")]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, raw in {**blobs, folder + "constants.pkl": pickle.dumps((), protocol=2)}.items():
            z.writestr(name, raw)
    assert meta_load(path) is None
    with pytest.raises(BadInput, match="weights_only"):
        read_structure(path)


def _refoldered(tmp_path: Path, folder: str) -> Path:
    """A SpecForge sample whose archive folder is renamed ``folder`` (Python's zipfile writes it)."""
    src = tmp_path / "src.ckpt"
    torch.save({"input_ids": torch.arange(6)[None], "loss_mask": torch.ones(1, 6), "aux_hidden_state": torch.randn(1, 6, 12),
                "hidden_state": torch.randn(1, 6, 4)}, src)
    dst = tmp_path / "dst.ckpt"
    with zipfile.ZipFile(src) as zs, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zd:
        for i in zs.infolist():
            zd.writestr(f"{folder}/" + i.filename.split("/", 1)[1], zs.read(i.filename))
    return dst


def test_an_archive_folder_named_in_utf8_is_read_as_torch_reads_it(tmp_path):
    """torch <= 2.0 named the folder after the file; Python's zipfile, like torch's writer, flags
    such names UTF-8: both readers resolve them alike."""
    st_ = read_structure(_refoldered(tmp_path, "données_0"))
    assert st_.layout == "specforge" and st_.findings == [] and st_.rows is not None


_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                                 st.text(max_size=5)),
                       lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                                               st.dictionaries(st.text(max_size=3), inner, max_size=3)), max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(_values)
def test_the_opcode_walk_reads_a_protocol_2_pickle_as_pickletools_does(value):
    """Its opcodes and where each starts are pickletools' (what follows each opcode is read right),
    and a pickle of plain values is one it takes."""
    import pickletools

    from surgeon.audit.torchzip import OPCODES, _ops, _plain

    data = pickle.dumps(value, protocol=2)
    if any(op.name not in OPCODES for op, _, _ in pickletools.genops(data)):
        assert not _plain(data)  # e.g. BINBYTES, SHORT_BINSTRING: not what torch.save writes
        return
    extra = {0x58: 4, 0x8A: 1, 0x63: 1}  # BINUNICODE's and LONG1's length, GLOBAL's last newline
    got, at = [], 0
    for op, arg in _ops(data):
        got.append((op, at))
        at += 1 + len(arg) + extra.get(op, 0)
    assert got == [(op.code.encode("latin-1")[0], pos) for op, _, pos in pickletools.genops(data)] and _plain(data)


def test_a_memo_slot_out_of_order_is_refused_before_the_unpickler_sizes_its_memo_by_it():
    """The C unpickler's memo is an array as long as the largest slot: 6 bytes would cost 1 GB."""
    from surgeon.audit.torchzip import _plain

    good = _dict(x=_tensor("0", 4))
    assert _plain(good)
    assert not _plain(good[:-2] + b"r" + (0x04000000).to_bytes(4, "little") + good[-2:])  # LONG_BINPUT of x's dict


def _rezipped(src: Path, dst: Path, extra: dict[str, bytes], change=lambda name, raw: raw) -> Path:
    with zipfile.ZipFile(src) as zs, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zd:
        for i in zs.infolist():
            zd.writestr(i.filename, change(i.filename, zs.read(i.filename)))
        for name, raw in extra.items():
            zd.writestr(name, raw)
    return dst


@pytest.mark.parametrize("case", ["alignment", "outside_the_folder"])
def test_what_torch_load_checks_before_it_unpickles_is_checked(tmp_path, case):
    """A storage alignment that is no integer, an entry outside the archive folder: torch.load
    refuses both, on the CPU too; so the structure pass does (it read them clean before)."""
    src = tmp_path / "src.ckpt"
    torch.save({"x": torch.ones(2)}, src)
    dst = _rezipped(src, tmp_path / "dst.ckpt", {"readme.txt": b"hi"} if case == "outside_the_folder" else {},
                    lambda name, raw: b"x" if name.endswith("/.storage_alignment") else raw)
    with pytest.raises(Exception):  # noqa: B017 - the verdict is torch's: whatever it raises
        torch.load(dst, weights_only=True)
    assert meta_load(dst) is None
    with pytest.raises(BadInput, match="weights_only"):
        read_structure(dst)


def test_two_zips_joined_are_refused_by_the_gate(tmp_path):
    """Python's zipfile reads the second (its directory is at the end), torch's reader the first."""
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    torch.save({"x": torch.full((4,), float("nan"))}, a)
    torch.save({"x": torch.ones(4)}, b)
    joined = tmp_path / "joined.ckpt"
    joined.write_bytes(a.read_bytes() + b.read_bytes())
    with pytest.raises(BadInput, match="two zips joined"):
        open_tensor_file(joined)


def test_an_unflagged_non_ascii_folder_name_is_read(tmp_path):
    """Info-ZIP does not flag a name UTF-8; Python decodes it as cp437, one character a byte, so its
    bytes are known and nothing is ambiguous."""
    dst = _refoldered(tmp_path, "donnXes_0")
    dst.write_bytes(dst.read_bytes().replace(b"donnXes_0/", b"donn\x82es_0/"))  # cp437 'é', no UTF-8 flag
    assert all(not i.flag_bits & 0x800 and "é" in i.filename for i in zipfile.ZipFile(dst).infolist())
    st_ = read_structure(dst)
    assert st_.layout == "specforge" and st_.findings == [] and st_.rows is not None
