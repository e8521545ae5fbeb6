"""Reference capture on real (tiny, random) transformers models.

Each point recorded by ``capture_reference``'s hooks is checked against what transformers
itself reports (``output_hidden_states``) and against an independent hook on the attention
branch, so the meaning of every point (and of the ``layer_delta`` mistake) is pinned down on
the installed transformers, family by family.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from surgeon.core.errors import BadInput  # noqa: E402
from surgeon.core.points import EMBED, FINAL_NORM, Point, layer_out  # noqa: E402
from surgeon.run.tinymodels import FAMILIES, GAP_SCALES, make_tiny_model  # noqa: E402
from surgeon.verify.reference import (  # noqa: E402
    Reference,
    adjacent_layer_gap,
    capture_reference,
    load_reference,
    save_reference,
    sweep_points,
)

IDS = [5, 17, 42, 99, 3, 250, 7, 128, 64, 11, 200, 31]
L = 4


def delta(k: int) -> Point:
    return Point("layer_delta", k)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float32 rounding of a few adds, relative to the states' size."""
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_model(family, root / family, num_layers=L) for family in FAMILIES}


def _hf_forward(model_dir, ids):
    """transformers' own view: output_hidden_states plus the attention branch's output, taken
    by a hook independent of capture_reference's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    attn: dict[int, torch.Tensor] = {}
    handles = [
        layer.self_attn.register_forward_hook(
            lambda m, a, out, k=k: attn.__setitem__(k, (out[0] if isinstance(out, tuple) else out)[0].detach().clone())
        )
        for k, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [h[0] for h in out.hidden_states], attn


# -- the meaning of every point, per family -----------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_points_match_transformers_and_the_residual_arithmetic(models, family):
    ref = capture_reference(models[family], IDS)
    hs, attn = _hf_forward(models[family], IDS)
    assert ref.num_layers == L and ref.hidden_size == 64
    assert list(ref.states) == sweep_points(L)
    assert torch.equal(ref.input_ids, torch.tensor(IDS))
    for t in ref.states.values():
        assert t.dtype == torch.float32 and t.device.type == "cpu" and tuple(t.shape) == (len(IDS), 64)
        assert torch.isfinite(t).all()

    # transformers' tuple: hs[0] = embed, hs[k+1] = layer_out[k] for k < L-1, hs[L] = final_norm
    assert len(hs) == L + 1
    assert close(ref.states[EMBED], hs[0])
    for k in range(L - 1):
        assert close(ref.states[layer_out(k)], hs[k + 1]), k
    assert close(ref.states[FINAL_NORM], hs[L])
    # ... so the last layer's output (pre-norm) is not in the tuple
    assert not close(ref.states[layer_out(L - 1)], hs[L])

    # layer_delta[k] is the MLP branch alone; adding back the residual entering the MLP
    # (= layer_in + attention output) gives layer_out[k]
    for k in range(L):
        prev = ref.states[EMBED] if k == 0 else ref.states[layer_out(k - 1)]
        out, d = ref.states[layer_out(k)], ref.states[delta(k)]
        assert not close(d, out), k
        assert attn[k].abs().max() > 0
        assert close(out - d - prev, attn[k]), k
        assert not close(out - d, prev), k  # the attention branch is really there


@pytest.mark.slow  # a 61-layer reference model
def test_deepseek_v3_at_kimi_depth_with_realistic_gaps(tmp_path):
    model = make_tiny_model("deepseek_v3", tmp_path / "dsv3", num_layers=61, residual_scale=GAP_SCALES["deepseek_v3"])
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["num_hidden_layers"] == 61
    dims = (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"], config["v_head_dim"])
    assert dims == (512, 64, 128, 128)
    assert (config["topk_method"], config["scoring_func"], config["first_k_dense_replace"]) == ("noaux_tc", "sigmoid", 1)
    ref = capture_reference(model, IDS)
    assert ref.num_layers == 61
    assert list(ref.states) == sweep_points(61) and len(ref.states) == 2 * 61 + 2
    assert all(torch.isfinite(t).all() for t in ref.states.values())
    assert not close(ref.states[layer_out(60)], ref.states[FINAL_NORM])
    assert 0.01 <= adjacent_layer_gap(ref) <= 0.03


# -- residual_scale -----------------------------------------------------------------------


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "deepseek_v3"])  # dsv3: above
def test_gap_scales_give_adjacent_layer_gaps_of_one_to_three_percent(models, tmp_path, family):
    scaled = capture_reference(make_tiny_model(family, tmp_path / "s", num_layers=8, residual_scale=GAP_SCALES[family]), IDS)
    assert 0.01 <= adjacent_layer_gap(scaled) <= 0.03
    assert adjacent_layer_gap(capture_reference(models[family], IDS)) > 0.2  # random init: far apart


def test_residual_scale_multiplies_exactly_the_branch_output_projections(tmp_path):
    plain = load_file(make_tiny_model("deepseek_v3", tmp_path / "a", num_layers=2) / "model.safetensors")
    scaled = load_file(make_tiny_model("deepseek_v3", tmp_path / "b", num_layers=2, residual_scale=0.5) / "model.safetensors")
    assert plain.keys() == scaled.keys()
    hit = set()
    for name, t in plain.items():
        if "o_proj" in name.split(".") or "down_proj" in name.split("."):
            assert torch.equal(scaled[name], t * 0.5), name
            hit.add(name.split(".mlp.")[-1] if ".mlp." in name else "o_proj")
        else:
            assert torch.equal(scaled[name], t), name
    # dense MLP (layer 0), routed experts (saved one per expert, the checkpoint layout engines
    # load), shared expert, attention
    assert {"o_proj", "down_proj.weight", "experts.3.down_proj.weight", "shared_experts.down_proj.weight"} <= hit


def test_tiny_models_are_deterministic_and_leave_the_callers_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = load_file(make_tiny_model("qwen3", tmp_path / "a", num_layers=2) / "model.safetensors")
    assert torch.equal(torch.rand(3), expected)
    b = load_file(make_tiny_model("qwen3", tmp_path / "b", num_layers=2) / "model.safetensors")
    c = load_file(make_tiny_model("qwen3", tmp_path / "c", num_layers=2, seed=1) / "model.safetensors")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], c[n]) for n in a)


def test_bfloat16_model_keeps_the_router_in_float32_like_transformers(tmp_path):
    model = make_tiny_model("deepseek_v3", tmp_path / "bf16", num_layers=2, dtype="bfloat16")
    assert json.loads((model / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = load_file(model / "model.safetensors")
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert tensors["model.layers.0.self_attn.o_proj.weight"].dtype == torch.bfloat16
    ref = capture_reference(model, IDS, dtype=torch.bfloat16)
    assert all(t.dtype == torch.float32 for t in ref.states.values())


def test_unknown_family_is_refused():
    with pytest.raises(BadInput, match="unknown tiny-model family 'gpt2'"):
        make_tiny_model("gpt2", "/nonexistent")


# -- input validation ---------------------------------------------------------------------


def test_input_ids_forms_and_refusals(models):
    llama = models["llama"]
    a = capture_reference(llama, torch.tensor([IDS]))
    b = capture_reference(llama, IDS)
    assert all(torch.equal(a.states[p], b.states[p]) for p in sweep_points(L))
    for bad, match in [
        ([1, 2, 320], "token id 320 is out of the vocabulary \\(0..319\\)"),
        ([-1, 2], "token id -1 is out of the vocabulary"),
        ([], "empty"),
        (torch.tensor([1.0, 2.0]), "integers"),
        ([1, True], "integers"),
        ("1 2 3", "list of token ids"),
        (torch.zeros(2, 3, dtype=torch.long), "1-D"),
    ]:
        with pytest.raises(BadInput, match=match):
            capture_reference(llama, bad)


def test_not_a_model_or_an_unrecognised_structure_is_bad_input(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    with pytest.raises(BadInput, match="not a model directory"):
        capture_reference(tmp_path / "missing", IDS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInput, match="no config.json"):
        capture_reference(tmp_path / "empty", IDS)
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=320))
    gpt2.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(BadInput, match="unrecognised model structure") as e:
        capture_reference(tmp_path / "gpt2", IDS)
    assert "\n" not in str(e.value)


# -- files --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_ref(models):
    return capture_reference(models["llama"], IDS)


def test_save_load_round_trip_is_exact(llama_ref, tmp_path):
    path = tmp_path / "ref.safetensors"
    save_reference(llama_ref, path)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {
            "surgeon.kind": "reference",
            "num_layers": str(L),
            "hidden_size": "64",
            "source": llama_ref.source,
        }
        assert set(f.keys()) == {str(p) for p in sweep_points(L)} | {"input_ids"}
        assert "layer_out[3]" in f.keys() and "layer_delta[0]" in f.keys()
    back = load_reference(path)
    assert isinstance(back, Reference)
    assert (back.num_layers, back.hidden_size, back.source) == (L, 64, llama_ref.source)
    assert llama_ref.source.startswith("hf:")
    assert torch.equal(back.input_ids, llama_ref.input_ids) and back.input_ids.dtype == torch.int64
    assert list(back.states) == list(llama_ref.states)
    assert all(torch.equal(back.states[p], llama_ref.states[p]) for p in llama_ref.states)
    assert torch.equal(back["layer_in[2]"], llama_ref.states[layer_out(1)])


def _rewrite(src, dst, *, metadata_patch=None, drop=None, replace=None):
    tensors = load_file(str(src))
    with safe_open(str(src), framework="pt") as f:
        metadata = dict(f.metadata())
    metadata.update(metadata_patch or {})
    metadata = {k: v for k, v in metadata.items() if v is not None}
    if drop:
        del tensors[drop]
    tensors.update(replace or {})
    save_file(tensors, str(dst), metadata=metadata)
    return dst


def test_malformed_reference_files_are_bad_input(llama_ref, tmp_path):
    good = tmp_path / "good.safetensors"
    save_reference(llama_ref, good)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00\x01not a safetensors file at all")
    huge_header = tmp_path / "huge.safetensors"
    huge_header.write_bytes((2**40).to_bytes(8, "little") + b"{}")
    cases = {
        junk: "not a readable safetensors file",
        huge_header: "not a readable safetensors file",
        tmp_path / "absent.safetensors": "no such file",
        _rewrite(good, tmp_path / "kind.st", metadata_patch={"surgeon.kind": "dump"}): "surgeon.kind is 'dump'",
        _rewrite(good, tmp_path / "nokind.st", metadata_patch={"surgeon.kind": None}): "surgeon.kind is None",
        _rewrite(good, tmp_path / "nolayers.st", metadata_patch={"num_layers": None}): "no 'num_layers'",
        _rewrite(good, tmp_path / "intlayers.st", metadata_patch={"num_layers": "four"}): "not integers",
        _rewrite(good, tmp_path / "morelayers.st", metadata_patch={"num_layers": "5"}): "missing tensor 'layer_delta\\[4\\]'",
        _rewrite(good, tmp_path / "fewer.st", metadata_patch={"num_layers": "3"}): "unexpected tensor 'layer_delta\\[3\\]'",
        _rewrite(good, tmp_path / "noids.st", drop="input_ids"): "no 'input_ids'",
        _rewrite(good, tmp_path / "nostate.st", drop="final_norm"): "missing tensor 'final_norm'",
        _rewrite(good, tmp_path / "shape.st", replace={"embed": torch.zeros(3, 64)}): "embed is torch.float32 \\[3, 64\\]",
        _rewrite(good, tmp_path / "dtype.st", replace={"input_ids": torch.zeros(12, dtype=torch.int32)}): "int64",
        _rewrite(good, tmp_path / "width.st", metadata_patch={"hidden_size": "32"}): "expected float32 \\[12, 32\\]",
    }
    for path, match in cases.items():
        with pytest.raises(BadInput, match=match) as e:
            load_reference(path)
        assert "\n" not in str(e.value), path
