"""The asynchronous dump writer and the SpecForge / speculators exporters.

Round trips keep every value exactly and every slot names its point; every refusal is one line;
the writer bounds memory (backpressure), surfaces thread errors, and never leaves a partial shard.
"""

import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import surgeon.capture.dumps as dumps
from surgeon.capture.dumps import read_dump
from surgeon.capture.dumpwriter import DumpWriter, list_shards
from surgeon.capture.exporters import export_specforge, export_speculators
from surgeon.core.errors import BadInput
from surgeon.core.points import EMBED, FINAL_NORM, layer_out
from surgeon.core.spec import load_spec
from surgeon.verify.subjects import read_subject

L, H = 4, 8


def make_spec(tmp_path, fc="[a, b, c]", captures=None, name="s.yaml"):
    captures = captures or {"e": "embed", "a": "layer_out[0]", "b": "layer_out[1]", "c": "layer_out[2]",
                            "pre": "layer_out[3]", "post": "final_norm"}
    caps = "\n".join(f"  {k}: {v}" for k, v in captures.items())
    text = textwrap.dedent(f"""\
        spec: 1
        name: tiny
        target: {{architecture: TinyForCausalLM, num_layers: {L}, hidden_size: {H}}}
        captures:
        """) + caps + f"\ndraft: {{kind: eagle3, fc_input: {fc}}}\n"
    f = tmp_path / name
    f.write_text(text)
    return load_spec(f)


def step(spec, T, seed, names=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    names = names or list(spec.captures)
    caps = [(n, spec.captures[n], torch.randn(T, H, generator=g).to(dtype)) for n in names]
    ids = torch.randint(0, 1000, (T,), generator=g)
    return caps, ids


def write_steps(tmp_path, spec, steps, **kw):
    out = tmp_path / "dump"
    with DumpWriter(out, spec=spec, engine="hf", engine_version="5.19", model="tiny", **kw) as w:
        for caps, ids in steps:
            w.submit(caps, ids)
    return out, w


# -- round trip --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_writer_dumps_and_both_exporters(tmp_path, dtype):
    spec = make_spec(tmp_path)
    steps = [step(spec, T, i, dtype=dtype) for i, T in enumerate([5, 3, 7])]
    out, w = write_steps(tmp_path, spec, steps)
    shards = list_shards(out)
    assert [p.name for p in shards] == ["shard-000000.safetensors", "shard-000001.safetensors", "shard-000002.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == [p.name for p in shards]  # no temp left, listing = order
    assert w.tokens_written == 15
    for (caps, ids), path in zip(steps, shards):
        d = read_dump(path)
        assert d.meta["engine"] == "hf" and d.meta["spec.name"] == "tiny" and d.num_layers == L
        assert torch.equal(d.input_ids, ids)
        assert [(n, p) for n, p, _ in d.captures] == [(n, p) for n, p, _ in caps]
        for (_, _, want), (_, _, got) in zip(caps, d.captures):
            assert got.dtype == dtype and torch.equal(got, want)
        sub = read_subject(path)  # the dump names every slot's point
        assert sub.layout == "surgeon" and [pt for _, pt, _ in sub.slots] == [p for _, p, _ in caps]

    sf = export_specforge(out, tmp_path / "sf", spec=spec)
    assert [p.name for p in sf] == ["data_0.ckpt", "data_1.ckpt", "data_2.ckpt"]
    for (caps, ids), path in zip(steps, sf):
        by = {n: t for n, _, t in caps}
        data = torch.load(path, weights_only=True)
        assert set(data) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        T = ids.numel()
        assert torch.equal(data["input_ids"], ids.reshape(1, T))
        assert torch.equal(data["loss_mask"], torch.ones(1, T, dtype=torch.int64))
        assert data["aux_hidden_state"].shape == (1, T, 3 * H) and data["aux_hidden_state"].dtype == dtype
        assert torch.equal(data["aux_hidden_state"], torch.cat([by["a"], by["b"], by["c"]], -1)[None])
        assert torch.equal(data["hidden_state"], by["post"][None])  # post-norm, not layer_out[L-1]
        sub = read_subject(path)
        assert sub.layout == "specforge" and sub.names == ["aux_0", "aux_1", "aux_2", "hidden_state"]
        assert [d for _, d, _ in sub.slots] == [spec.captures[n] for n in ("a", "b", "c")] + [FINAL_NORM]
        for (_, _, got), want in zip(sub.slots, [by["a"], by["b"], by["c"], by["post"]]):
            assert torch.equal(got, want)
        assert torch.equal(sub.input_ids.reshape(-1), ids)

    sp = export_speculators([out], tmp_path / "sp", spec=spec)
    assert [p.name for p in sp] == ["hs_0.safetensors", "hs_1.safetensors", "hs_2.safetensors"]
    for (caps, ids), path in zip(steps, sp):
        by = {n: t for n, _, t in caps}
        data = load_file(str(path))
        assert set(data) == {"token_ids", "hidden_states"}
        assert torch.equal(data["token_ids"], ids)
        assert data["hidden_states"].shape == (ids.numel(), 4, H) and data["hidden_states"].dtype == dtype
        assert torch.equal(data["hidden_states"], torch.stack([by["a"], by["b"], by["c"], by["pre"]], 1))  # pre-norm last
        sub = read_subject(path, num_layers=L)  # declared by the export's record beside it, not assumed
        assert sub.layout == "vllm-connector" and sub.slots[-1][1] == layer_out(L - 1)
        assert [d for _, d, _ in sub.slots] == [spec.captures[n] for n in ("a", "b", "c")] + [layer_out(L - 1)]
        assert torch.equal(sub.slots[-1][2], by["pre"])


def test_fc_order_is_the_specs_not_the_dumps(tmp_path):
    spec = make_spec(tmp_path)
    caps, ids = step(spec, 4, 0, names=["post", "pre", "c", "b", "a"])  # slot order differs from fc order
    out, _ = write_steps(tmp_path, spec, [(caps, ids)])
    by = {n: t for n, _, t in caps}
    data = torch.load(export_specforge(out, tmp_path / "sf", spec=spec)[0], weights_only=True)
    assert torch.equal(data["aux_hidden_state"][0], torch.cat([by["a"], by["b"], by["c"]], -1))
    hs = load_file(str(export_speculators(out, tmp_path / "sp", spec=spec)[0]))["hidden_states"]
    assert torch.equal(hs, torch.stack([by["a"], by["b"], by["c"], by["pre"]], 1))


def test_shard_tokens_groups_steps_and_flush_writes_the_rest(tmp_path):
    spec = make_spec(tmp_path)
    steps = [step(spec, 4, i) for i in range(5)]
    out = tmp_path / "dump"
    with DumpWriter(out, spec=spec, shard_tokens=8, max_queue=2) as w:
        for caps, ids in steps:
            w.submit(caps, ids)
        w.flush()
        assert len(list_shards(out)) == 3  # 8 + 8 + 4 (flushed)
    shards = list_shards(out)
    assert len(shards) == 3
    got = torch.cat([read_dump(p).captures[1][2] for p in shards])
    assert torch.equal(got, torch.cat([c[1][2] for c, _ in steps]))
    ids = torch.cat([read_dump(p).input_ids for p in shards])
    assert torch.equal(ids, torch.cat([i for _, i in steps]))


def test_shard_indices_continue_after_existing_shards(tmp_path):
    spec = make_spec(tmp_path)
    out, _ = write_steps(tmp_path, spec, [step(spec, 2, 0)])
    write_steps(tmp_path, spec, [step(spec, 2, 1)])
    assert [p.name for p in list_shards(out)] == ["shard-000000.safetensors", "shard-000001.safetensors"]


def test_staging_copies_so_later_mutation_does_not_leak(tmp_path):
    spec = make_spec(tmp_path)
    caps, ids = step(spec, 3, 0)
    keep = [t.clone() for _, _, t in caps]
    out = tmp_path / "dump"
    with DumpWriter(out, spec=spec) as w:
        w.submit(caps, ids)
        for _, _, t in caps:
            t.zero_()  # the engine reuses its activation buffers
    for want, (_, _, got) in zip(keep, read_dump(list_shards(out)[0]).captures):
        assert torch.equal(got, want)


# -- refusals ----------------------------------------------------------------------------------
def one_line_refusal(fn, *needles):
    with pytest.raises(BadInput) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_specforge_refuses_without_final_norm(tmp_path):
    spec = make_spec(tmp_path)
    out, _ = write_steps(tmp_path, spec, [step(spec, 3, 0, names=["a", "b", "c", "pre"])])
    one_line_refusal(lambda: export_specforge(out, tmp_path / "sf", spec=spec), "final_norm", "SpecForge")
    assert not (tmp_path / "sf").exists() or not any((tmp_path / "sf").iterdir())


def test_specforge_refuses_missing_fc_capture(tmp_path):
    spec = make_spec(tmp_path)
    out, _ = write_steps(tmp_path, spec, [step(spec, 3, 0, names=["a", "c", "post", "pre"])])
    one_line_refusal(lambda: export_specforge(out, tmp_path / "sf", spec=spec), "layer_out[1]", "'b'")


def test_specforge_refuses_embed(tmp_path):
    spec = make_spec(tmp_path, fc="[e, a, b]")
    out, _ = write_steps(tmp_path, spec, [step(spec, 3, 0)])
    one_line_refusal(lambda: export_specforge(out, tmp_path / "sf", spec=spec), "embed", "SpecForge")


def test_specforge_refuses_last_layer_as_aux(tmp_path):
    spec = make_spec(tmp_path, fc="[a, b, pre]")
    out, _ = write_steps(tmp_path, spec, [step(spec, 3, 0)])
    one_line_refusal(lambda: export_specforge(out, tmp_path / "sf", spec=spec), f"layer_out[{L - 1}]")


def test_specforge_refuses_out_of_layer_order(tmp_path):
    spec = make_spec(tmp_path, fc="[b, a, c]")
    out, _ = write_steps(tmp_path, spec, [step(spec, 3, 0)])
    one_line_refusal(lambda: export_specforge(out, tmp_path / "sf", spec=spec), "order")


def test_speculators_refuses_without_pre_norm_last_layer(tmp_path):
    spec = make_spec(tmp_path)
    out, _ = write_steps(tmp_path, spec, [step(spec, 3, 0, names=["a", "b", "c", "post"])])  # final_norm only
    one_line_refusal(lambda: export_speculators(out, tmp_path / "sp", spec=spec),
                     f"layer_out[{L - 1}]", "final_norm is not a substitute")


def test_speculators_refuses_missing_fc_capture(tmp_path):
    spec = make_spec(tmp_path)
    out, _ = write_steps(tmp_path, spec, [step(spec, 3, 0, names=["a", "b", "pre"])])
    one_line_refusal(lambda: export_speculators(out, tmp_path / "sp", spec=spec), "layer_out[2]", "'c'")


def test_speculators_refuses_descending_fc(tmp_path):
    spec = make_spec(tmp_path, fc="[c, b, a]")
    out, _ = write_steps(tmp_path, spec, [step(spec, 3, 0)])
    one_line_refusal(lambda: export_speculators(out, tmp_path / "sp", spec=spec), "ascending")


def test_exporters_refuse_mislabelled_capture(tmp_path):
    spec = make_spec(tmp_path)
    caps, ids = step(spec, 3, 0)
    caps = [(n, layer_out(1) if n == "a" else p, t) for n, p, t in caps if n != "b"]
    path = tmp_path / "x.safetensors"
    dumps.write_dump(path, caps, input_ids=ids, num_layers=L, spec=spec)
    one_line_refusal(lambda: export_specforge([path], tmp_path / "sf", spec=spec), "'a'", "layer_out[1]")
    one_line_refusal(lambda: export_speculators([path], tmp_path / "sp", spec=spec), "'a'", "layer_out[1]")


def test_exporters_refuse_spec_of_another_model_and_empty_dir(tmp_path):
    spec = make_spec(tmp_path)
    out, _ = write_steps(tmp_path, spec, [step(spec, 3, 0)])
    other = tmp_path / "o.yaml"
    other.write_text((tmp_path / "s.yaml").read_text().replace(f"num_layers: {L}", "num_layers: 6"))
    one_line_refusal(lambda: export_specforge(out, tmp_path / "sf", spec=load_spec(other)), "6")
    (tmp_path / "empty").mkdir()
    one_line_refusal(lambda: export_speculators(tmp_path / "empty", tmp_path / "sp", spec=spec), "no shard")


def test_submit_refuses_captures_the_spec_does_not_declare(tmp_path):
    spec = make_spec(tmp_path)
    with DumpWriter(tmp_path / "d", spec=spec) as w:
        one_line_refusal(lambda: w.submit([("a", layer_out(1), torch.zeros(2, H))], torch.zeros(2, dtype=torch.long)),
                         "'a'", "layer_out[0]")
        one_line_refusal(lambda: w.submit([("zz", EMBED, torch.zeros(2, H))], torch.zeros(2, dtype=torch.long)), "'zz'")
        one_line_refusal(lambda: w.submit([("e", EMBED, torch.zeros(3, H))], torch.zeros(2, dtype=torch.long)), "[2, 8]")
        one_line_refusal(lambda: w.submit([("post", FINAL_NORM, torch.zeros(2, H + 1))], torch.zeros(2, dtype=torch.long)),
                         "[2, 8]")
    assert list_shards(tmp_path / "d") == []


# -- backpressure, errors, crash safety --------------------------------------------------------
def slow_write(monkeypatch, delay, gate=None):
    real = dumps.write_dump

    def slow(*a, **kw):
        if gate is not None:
            gate.wait()
        time.sleep(delay)
        return real(*a, **kw)

    monkeypatch.setattr(dumps, "write_dump", slow)


def test_backpressure_blocks_submit_and_bounds_staging(tmp_path, monkeypatch):
    gate = threading.Event()
    slow_write(monkeypatch, 0.0, gate)
    spec = make_spec(tmp_path)
    max_queue = 2
    w = DumpWriter(tmp_path / "d", spec=spec, max_queue=max_queue)
    submitted = []

    def producer():
        for i in range(8):
            w.submit(*step(spec, 4, i))
            submitted.append(i)

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.5)
    # writer is stuck on the first shard: max_queue waiting + 1 in the writer, the next submit blocks
    assert len(submitted) == max_queue + 1 and t.is_alive()
    assert w.peak_in_use == max_queue + 1
    gate.set()
    t.join(10)
    w.close()
    assert not t.is_alive() and len(submitted) == 8
    assert w.peak_in_use <= max_queue + 1 and w._allocated <= max_queue + 1
    assert len(list_shards(tmp_path / "d")) == 8


def test_slow_writer_throttles_producer(tmp_path, monkeypatch):
    slow_write(monkeypatch, 0.05)
    spec = make_spec(tmp_path)
    t0 = time.perf_counter()
    with DumpWriter(tmp_path / "d", spec=spec, max_queue=1) as w:
        for i in range(8):
            w.submit(*step(spec, 4, i))
        submit_time = time.perf_counter() - t0
    assert submit_time >= 0.05 * (8 - 2) * 0.9  # at most 2 steps ahead of the writer
    assert w.peak_in_use <= 2


def test_writer_error_surfaces_on_next_call(tmp_path, monkeypatch):
    spec = make_spec(tmp_path)

    def broken(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dumps, "write_dump", broken)
    w = DumpWriter(tmp_path / "d", spec=spec)
    w.submit(*step(spec, 3, 0))  # accepted: the failure happens in the thread
    with pytest.raises(OSError, match="No space left"):
        w.flush()
    with pytest.raises(OSError, match="No space left"):  # stays failed: no step is silently dropped
        w.submit(*step(spec, 3, 1))
    with pytest.raises(OSError, match="No space left"):
        w.close()


def test_writer_error_surfaces_on_submit_and_close(tmp_path, monkeypatch):
    spec = make_spec(tmp_path)
    calls = []

    def broken(*a, **kw):
        calls.append(1)
        raise RuntimeError("disk gone")

    monkeypatch.setattr(dumps, "write_dump", broken)
    w = DumpWriter(tmp_path / "d", spec=spec, max_queue=1)
    with pytest.raises(RuntimeError, match="disk gone"):
        for i in range(50):
            w.submit(*step(spec, 3, i))
            time.sleep(0.01)
    with pytest.raises(RuntimeError, match="disk gone"):
        w.close()
    assert len(calls) == 1  # nothing written after the failure


def test_context_manager_does_not_mask_the_callers_exception(tmp_path, monkeypatch):
    spec = make_spec(tmp_path)
    monkeypatch.setattr(dumps, "write_dump", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("writer")))
    with pytest.raises(KeyError):
        with DumpWriter(tmp_path / "d", spec=spec) as w:
            w.submit(*step(spec, 3, 0))
            raise KeyError("caller")


def test_crash_mid_write_leaves_no_partial_shard(tmp_path, monkeypatch):
    import safetensors.torch as st

    spec = make_spec(tmp_path)

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x00" * 100)  # half a file, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(st, "save_file", crash)
    w = DumpWriter(tmp_path / "d", spec=spec)
    w.submit(*step(spec, 3, 0))
    with pytest.raises(KeyboardInterrupt):
        w.close()
    assert list((tmp_path / "d").glob("*.safetensors")) == []


def test_reader_never_sees_a_partial_shard(tmp_path):
    spec = make_spec(tmp_path)
    out = tmp_path / "d"
    out.mkdir()
    seen, bad = set(), []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            for p in out.glob("*.safetensors"):
                if p.name in seen:
                    continue
                try:
                    read_dump(p)
                    seen.add(p.name)
                except BadInput as e:
                    bad.append(str(e))

    r = threading.Thread(target=reader)
    r.start()
    with DumpWriter(out, spec=spec) as w:
        for i in range(30):
            w.submit(*step(spec, 64, i))
    stop.set()
    r.join()
    assert bad == []
    assert all(p.name.startswith("shard-") for p in out.glob("*.safetensors"))
    assert not [p for p in out.iterdir() if not p.name.endswith(".safetensors")]  # no temp left
