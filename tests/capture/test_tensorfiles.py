"""The one gate every tensor file passes (surgeon.capture.tensorfiles.open_tensor_file): a regular
file with a sane header before any read; FIFOs, devices, directories, truncated or lying headers
and degenerate shapes are exit 2 with one line naming the file, never a hang or a traceback.

FIFO cases run the real CLI in a subprocess under a timeout: the bug they guard against is a
reader blocked forever on open()."""

import json
import os
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import surgeon.capture.tensorfiles as tf
from surgeon.capture.dumps import write_dump
from surgeon.capture.tensorfiles import PICKLE, SAFETENSORS, ZIP, open_tensor_file
from surgeon.cli import main
from surgeon.core.errors import BadInput
from surgeon.core.points import EMBED, FINAL_NORM, layer_out
from surgeon.verify.reference import Reference, save_reference, sweep_points

L, H, T = 2, 8, 4
IDS = torch.arange(3, 3 + T)


def surgeon(*args, timeout=90):
    """The real CLI in its own process; a hang fails the test instead of blocking the suite."""
    started = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", "surgeon", *map(str, args)], capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"surgeon {' '.join(map(str, args))} still running after {timeout}s: it hangs")
    return p, time.monotonic() - started


def cli(*args, code=2):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == code, (res.exit_code, res.output)
    assert "Traceback" not in res.output
    return res.stderr


@pytest.fixture
def files(tmp_path):
    """A FIFO, a reference, a spec, a SpecForge subject and a dump, all tiny."""
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    g = torch.Generator().manual_seed(0)
    ref = Reference({p: torch.randn(T, H, generator=g) for p in sweep_points(L)}, IDS, L, H, "test")
    save_reference(ref, tmp_path / "ref.safetensors")
    spec = tmp_path / "s.yaml"
    spec.write_text(textwrap.dedent(f"""\
        spec: 1
        name: tiny
        target: {{architecture: TinyForCausalLM, num_layers: {L}, hidden_size: {H}}}
        captures: {{a: embed, b: 'layer_out[0]', c: 'layer_out[1]', post: final_norm}}
        draft: {{kind: eagle3, fc_input: [b]}}
        """))
    write_dump(tmp_path / "dump.safetensors", [(n, p, ref.states[p]) for n, p in
                                               (("a", EMBED), ("b", layer_out(0)), ("c", layer_out(1)), ("post", FINAL_NORM))],
               input_ids=IDS, num_layers=L)
    return {"fifo": fifo, "ref": tmp_path / "ref.safetensors", "spec": spec, "dump": tmp_path / "dump.safetensors",
            "tmp": tmp_path, "states": ref.states}


# -- the gate itself -------------------------------------------------------------------------------------------


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(BadInput, match=r"f: is a FIFO \(named pipe\), not a tensor file"):
        open_tensor_file(fifo)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("path, needle", [
    ("/dev/zero", "is a character device"),
    ("/dev/null", "is a character device"),
])
def test_devices_are_refused(path, needle):
    with pytest.raises(BadInput, match=needle):
        open_tensor_file(path)


def test_directories_missing_and_empty_files(tmp_path):
    with pytest.raises(BadInput, match="is a directory"):
        open_tensor_file(tmp_path)
    with pytest.raises(BadInput, match="no such file"):
        open_tensor_file(tmp_path / "absent")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(BadInput, match="it is empty"):
        open_tensor_file(tmp_path / "empty")


def _safetensors(tmp_path, tensors=None, metadata=None) -> Path:
    f = tmp_path / "x.safetensors"
    save_file(tensors or {"a": torch.zeros(3, 4)}, str(f), metadata=metadata)
    return f


def test_good_files_pass_with_their_header(tmp_path):
    f = _safetensors(tmp_path, {"a": torch.zeros(3, 4), "ids": torch.zeros(3, dtype=torch.int64)}, {"surgeon.kind": "dump"})
    gated = open_tensor_file(f)
    assert (gated.format, gated.kind, gated.shape("a"), gated.shape("ids")) == (SAFETENSORS, "dump", [3, 4], [3])
    torch.save({"x": torch.zeros(2)}, tmp_path / "new.pt")
    assert open_tensor_file(tmp_path / "new.pt").format == ZIP
    torch.save({"x": torch.zeros(2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert open_tensor_file(tmp_path / "old.pt").format == PICKLE
    # a symlink to a regular file is that file
    (tmp_path / "link.pt").symlink_to(tmp_path / "new.pt")
    assert open_tensor_file(tmp_path / "link.pt").format == ZIP


def test_truncated_and_lying_safetensors_headers(tmp_path):
    good = _safetensors(tmp_path).read_bytes()
    n = int.from_bytes(good[:8], "little")
    cases = {
        "truncated-header": good[: 8 + n // 2],
        "truncated-data": good[:-5],
        "huge-length": (2**60).to_bytes(8, "little") + b"{}",
        "not-json": (6).to_bytes(8, "little") + b"{nope}",
        "not-object": (4).to_bytes(8, "little") + b"{} 1",
        "bad-shape": None,
        "bad-offsets": None,
        "bad-meta": None,
    }

    def header(h):
        raw = json.dumps(h).encode()
        return len(raw).to_bytes(8, "little") + raw + b"\0" * 48

    cases["bad-shape"] = header({"a": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 48]}})
    cases["bad-offsets"] = header({"a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 4800]}})
    cases["bad-meta"] = header({"__metadata__": {"k": 1}})
    cases["wrong-size"] = header({"a": {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 48]}})
    needles = {"truncated-header": "header declares", "truncated-data": "truncated", "huge-length": "header declares 115",
               "not-json": "not JSON", "not-object": "not JSON", "bad-shape": "non-negative integers",
               "bad-offsets": "outside the 48 data bytes", "bad-meta": "__metadata__", "wrong-size": "holds 48 bytes"}
    for name, data in cases.items():
        f = tmp_path / f"{name}.safetensors"
        f.write_bytes(data)
        with pytest.raises(BadInput, match=needles[name]) as e:
            open_tensor_file(f)
        assert str(e.value).startswith(f"{f}: not a readable safetensors or torch.save file") and "\n" not in str(e.value)


def test_a_header_over_the_safetensors_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    f = _safetensors(tmp_path)
    monkeypatch.setattr(tf, "MAX_HEADER_BYTES", 16)
    monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("the header was parsed"))
    with pytest.raises(BadInput, match="over safetensors' limit of 16"):
        open_tensor_file(f)


def test_zip_and_pickle_headers(tmp_path):
    z = tmp_path / "a.zip"
    with zipfile.ZipFile(z, "w") as w:
        w.writestr("x.txt", "hi")
    with pytest.raises(BadInput, match="without the data.pkl"):
        open_tensor_file(z)
    torch.save({"x": torch.zeros(1000)}, tmp_path / "t.pt")
    cut = tmp_path / "cut.pt"
    cut.write_bytes((tmp_path / "t.pt").read_bytes()[:-200])
    with pytest.raises(BadInput, match="damaged zip|truncated"):
        open_tensor_file(cut)
    (tmp_path / "text").write_bytes(b"hello world, not tensors")
    with pytest.raises(BadInput, match="starts with 68 65 6c"):
        open_tensor_file(tmp_path / "text")
    with pytest.raises(BadInput, match="not a readable safetensors file"):
        open_tensor_file(tmp_path / "t.pt", formats=(SAFETENSORS,))


# -- every command that opens a tensor file, through the real CLI -----------------------------------------------


def test_fifos_are_exit_2_quickly_for_every_command(files):
    fifo, ref, spec, dump = files["fifo"], files["ref"], files["spec"], files["dump"]
    cases = [
        ("dump-info", fifo),
        ("export", fifo, "--spec", spec, "--layout", "speculators", "-o", files["tmp"] / "out"),
        ("match", fifo, "--reference", ref),
        ("match", dump, "--reference", fifo),
        ("verify", spec, "--subject", fifo, "--reference", ref),
        ("fingerprint", fifo, "-o", files["tmp"] / "fp.safetensors"),
    ]
    for args in cases:
        p, took = surgeon(*args)
        assert p.returncode == 2, (args, p.stderr)
        assert p.stderr.strip() == f"surgeon: {fifo}: is a FIFO (named pipe), not a tensor file", args
        assert took < 60, (args, took)
    assert not (files["tmp"] / "out").exists() and not (files["tmp"] / "fp.safetensors").exists()


def test_dev_zero_and_directories_are_named_for_what_they_are(files):
    ref, spec, tmp = files["ref"], files["spec"], files["tmp"]
    assert "/dev/zero: is a character device" in cli("match", "/dev/zero", "--reference", ref)
    assert "/dev/zero: is a character device" in cli("match", files["dump"], "--reference", "/dev/zero")
    assert "/dev/zero: is a character device" in cli("dump-info", "/dev/zero")
    assert "/dev/zero: is a character device" in cli("export", "/dev/zero", "--spec", spec, "--layout", "specforge",
                                                     "-o", tmp / "o")
    assert "a directory (use hf:DIR" in cli("match", files["dump"], "--reference", tmp)
    assert "no such file" in cli("match", files["dump"], "--reference", tmp / "absent")


def test_a_specforge_ckpt_of_hidden_size_0_is_bad_input(files):
    f = files["tmp"] / "data_0.ckpt"
    torch.save({"input_ids": IDS[None], "loss_mask": torch.ones(1, T), "aux_hidden_state": torch.zeros(1, T, 0),
                "hidden_state": torch.zeros(1, T, 0)}, f)
    assert "a hidden size of 0 holds no state" in cli("match", f, "--reference", files["ref"])


@pytest.mark.parametrize("layout", ["pt", "safetensors", "specforge"])
def test_a_subject_of_0_tokens_is_bad_input(files, layout):
    f = files["tmp"] / f"s.{layout}"
    if layout == "pt":
        torch.save([torch.zeros(0, H), torch.zeros(0, H)], f)
    elif layout == "safetensors":
        save_file({"a": torch.zeros(0, H)}, str(f))
    else:
        torch.save({"input_ids": torch.zeros(1, 0, dtype=torch.int64), "aux_hidden_state": torch.zeros(1, 0, 2 * H),
                    "hidden_state": torch.zeros(1, 0, H)}, f)
    err = cli("match", f, "--reference", files["ref"])
    assert "nothing to identify in 0 tokens" in err and err.count("\n") == 1


def test_dumps_of_0_tokens_or_with_lying_shapes_are_bad_input(files):
    tmp = files["tmp"]
    meta = {"surgeon.kind": "dump", "surgeon.format": "1", "num_layers": str(L), "hidden_size": str(H),
            "captures": json.dumps([{"name": "a", "point": "embed"}])}
    save_file({"input_ids": torch.zeros(0, dtype=torch.int64), "a": torch.zeros(0, H)}, str(tmp / "empty.st"), metadata=meta)
    assert "a dump holds at least one token" in cli("dump-info", tmp / "empty.st")
    save_file({"input_ids": IDS, "a": torch.zeros(T, H + 1)}, str(tmp / "wide.st"), metadata=meta)
    assert "capture 'a' has shape [4, 9], expected [4, 8]" in cli("dump-info", tmp / "wide.st")
    save_file({"input_ids": IDS, "a": torch.zeros(T, H)}, str(tmp / "h0.st"), metadata={**meta, "hidden_size": "0"})
    assert "malformed" in cli("dump-info", tmp / "h0.st")
    assert "has shape [4, 9], expected [4, 8]" in cli("export", tmp / "wide.st", "--spec", files["spec"], "--layout", "specforge",
                                    "-o", tmp / "o")
    assert not (tmp / "o").exists()


def test_a_subject_is_sniffed_once(files, monkeypatch):
    """read_subject used to open a file three times to tell its format; the gate's one open is the sniff."""
    from surgeon.verify.subjects import read_subject

    tmp = files["tmp"]
    ckpt = tmp / "data_0.ckpt"
    torch.save({"input_ids": IDS[None], "aux_hidden_state": torch.randn(1, T, 2 * H), "hidden_state": torch.randn(1, T, H)},
               ckpt)
    plain = tmp / "plain.safetensors"
    save_file({"x": torch.randn(T, H), "input_ids": IDS}, str(plain))
    from surgeon.capture import tensorfiles

    real_sniff, sniffed = tensorfiles._sniff, []

    def counting(p, *a, **k):
        sniffed.append(Path(p))
        return real_sniff(p, *a, **k)

    # The format is told once, by the gate; a reader that opens the file again afterwards reopens
    # the gate's file (checked to be the same inode, never sniffed again).
    monkeypatch.setattr(tensorfiles, "_sniff", counting)
    for path, layout, n in ((files["dump"], "surgeon", 4), (ckpt, "specforge", 3), (plain, "plain", 1)):
        sniffed.clear()
        s = read_subject(path)
        assert (s.layout, len(s.slots)) == (layout, n)
        assert sniffed.count(path) == 1, (path, sniffed)


def test_check_draft_reads_the_fc_shape_through_the_gate(tmp_path):
    """A draft's weights pass the same gate: a FIFO among them is named (it was skipped in silence),
    a truncated file is refused before any read, and a sound one gives its fc shape from the header."""
    root = Path(__file__).resolve().parents[2]
    spec = root / "specs" / "llama-3.1-8b-eagle3.yaml"
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}))
    save_file({"fc.weight": torch.zeros(4, 12)}, str(d / "model.safetensors"))
    res = CliRunner().invoke(main, ["check-draft", str(spec), str(d), "--engine", "sglang", "--json"])
    assert json.loads(res.stdout)["fc_weight"]["shape"] == [4, 12], res.output
    os.mkfifo(d / "a.safetensors")
    p, _ = surgeon("check-draft", spec, d, "--engine", "sglang")
    assert p.returncode == 2 and p.stderr == f"surgeon: {d / 'a.safetensors'}: is a FIFO (named pipe), not a tensor file\n"
    (d / "a.safetensors").unlink()
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-8])
    assert "truncated?" in cli("check-draft", spec, d, "--engine", "sglang")


def test_safetensors_whose_tensors_do_not_tile_their_data_are_refused_as_the_library_refuses_them(tmp_path):
    """A gap, an overlap, or bytes after the last tensor (a file rewritten in place, not truncated):
    safetensors' loader refuses each; the gate too, so no reader takes those bytes for data."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    def write(name, entries, data):
        raw = json.dumps(entries).encode()
        raw += b" " * (-len(raw) % 8)
        (tmp_path / name).write_bytes(len(raw).to_bytes(8, "little") + raw + data)
        return tmp_path / name

    a = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    cases = {"gap.safetensors": ({"a": a, "b": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]}}, 32, "a gap"),
             "overlap.safetensors": ({"a": a, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, 16,
                                     "they overlap"),
             "tail.safetensors": ({"a": a}, 20, "4 bytes after them")}
    for name, (entries, size, needle) in cases.items():
        p = write(name, entries, b"\0" * size)
        with pytest.raises(SafetensorError):
            load_file(str(p))
        with pytest.raises(BadInput, match=needle):
            open_tensor_file(p)
    empty = {"dtype": "F32", "shape": [0], "data_offsets": [16, 16]}  # a 0-size tensor anywhere tiles
    ok = write("ok.safetensors", {"b": empty, "a": a, "c": {"dtype": "F32", "shape": [1], "data_offsets": [16, 20]}},
               b"\0" * 20)
    assert set(load_file(str(ok))) == {"a", "b", "c"} and set(open_tensor_file(ok).tensors) == {"a", "b", "c"}
