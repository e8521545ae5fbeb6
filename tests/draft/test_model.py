"""EAGLE-3 draft loading in every layout, bad files, and the forward against transformers' modules."""

from __future__ import annotations

import json

import pytest
import torch

from surgeon.core.errors import BadInput
from surgeon.draft.layouts import EAGLE3_LAYOUTS, REQUIRED, config_for, read_checkpoint, rename_for, write_checkpoint
from surgeon.draft.model import DraftCache, load_draft, read_draft_info, teacher_forced

H, HEADS, KV, INTER, V, VD, N = 32, 4, 2, 48, 50, 40, 3


def random_state(seed: int = 0, *, embeddings: bool = True, vd: int = VD) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = H // HEADS

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    state = {
        "fc.weight": r(H, N * H),
        "midlayer.self_attn.q_proj.weight": r(HEADS * d, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(KV * d, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(KV * d, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, HEADS * d),
        "midlayer.mlp.gate_proj.weight": r(INTER, H),
        "midlayer.mlp.up_proj.weight": r(INTER, H),
        "midlayer.mlp.down_proj.weight": r(H, INTER),
        "midlayer.hidden_norm.weight": 1 + r(H),
        "midlayer.input_layernorm.weight": 1 + r(H),
        "midlayer.post_attention_layernorm.weight": 1 + r(H),
        "norm.weight": 1 + r(H),
        "lm_head.weight": r(vd, H),
    }
    if embeddings:
        state["embed_tokens.weight"] = r(V, H)
    if vd < V:
        kept = torch.sort(torch.randperm(V, generator=g)[:vd]).values
        state["d2t"] = kept - torch.arange(vd)  # offsets, as SpecForge writes them
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[kept] = True
        state["t2d"] = t2d
    return state


def write(tmp_path, layout, state=None, ids=(1, 3, 5), name=None):
    cfg = config_for(layout, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV,
                     intermediate_size=INTER, vocab_size=V, draft_vocab_size=VD,
                     ids=None if ids is None else list(ids))
    return write_checkpoint(tmp_path / (name or layout), layout, cfg, state if state is not None else random_state())


def inputs(seed=1, T=9):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, H, generator=g) for _ in range(N)], torch.randint(0, V, (T,), generator=g)


@pytest.mark.parametrize("layout", EAGLE3_LAYOUTS)
def test_round_trip_each_layout_with_real_key_names(tmp_path, layout):
    state = random_state()
    folder = write(tmp_path, layout, state)
    keys = set(read_checkpoint(folder).tensors)
    expected_marker = {"specforge": "midlayer.self_attn.q_proj.weight",
                       "speculators": "layers.0.self_attn.q_proj.weight",
                       "vllm": "model.layers.0.self_attn.qkv_proj.weight",
                       "sglang": "model.layers.0.self_attn.qkv_proj.weight"}[layout]
    assert expected_marker in keys
    draft = load_draft(folder)
    # SGLang's module names are vLLM's; only its legacy aux_norm_* names tell them apart
    assert draft.info.layout == ("vllm" if layout == "sglang" else layout) and draft.info.kind == "eagle3"
    assert (draft.info.n_slots, draft.info.hidden_size, draft.info.target_vocab_size,
            draft.info.draft_vocab_size) == (N, H, V, VD)
    own = draft.state_dict()
    for k in REQUIRED:
        assert torch.equal(own[k], state[k]), k
    assert torch.equal(own["d2t"], state["d2t"])
    stated = draft.info.stated_ids
    key = "eagle_aux_hidden_state_layer_ids" if layout == "speculators" else "eagle_config.eagle_aux_hidden_state_layer_ids"
    assert stated[key] == [1, 3, 5]


def test_all_layouts_give_the_same_forward(tmp_path):
    slots, ids = inputs()
    outs = []
    for layout in EAGLE3_LAYOUTS:
        draft = load_draft(write(tmp_path, layout))
        with torch.no_grad():
            outs.append(draft.step(draft.fuse(slots), ids))
    for logits, hidden in outs[1:]:
        assert torch.equal(logits, outs[0][0]) and torch.equal(hidden, outs[0][1])


def test_sglang_legacy_fc_norm_names(tmp_path):
    state = random_state()
    for i in range(N):
        state[f"fc_norm.{i}.weight"] = 1 + 0.1 * torch.arange(H, dtype=torch.float32) * (i + 1)
    cfg = config_for("sglang", hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV,
                     intermediate_size=INTER, vocab_size=V, draft_vocab_size=VD, ids=[1, 3, 5])
    cfg["fc_norm"] = True
    folder = write_checkpoint(tmp_path / "sg", "sglang", cfg, state)
    assert "model.aux_norm_mid.weight" in read_checkpoint(folder).tensors
    draft = load_draft(folder)
    assert draft.info.layout == "sglang"
    assert draft.fc_norm is not None and torch.equal(draft.fc_norm[1].weight, state["fc_norm.1.weight"])
    slots, _ = inputs()
    with torch.no_grad():
        normed = [draft.fc_norm[i](s) for i, s in enumerate(slots)]
        assert torch.allclose(draft.fuse(slots), torch.cat(normed, -1) @ state["fc.weight"].T, atol=1e-6)


def test_d2t_maps_draft_logits_into_the_target_vocab(tmp_path):
    state = random_state()
    draft = load_draft(write(tmp_path, "specforge", state))
    slots, ids = inputs()
    with torch.no_grad():
        logits, _ = draft.step(draft.fuse(slots), ids)
    kept = torch.arange(VD) + state["d2t"]
    assert torch.isinf(logits[:, ~state["t2d"]]).all()
    assert torch.isfinite(logits[:, kept]).all()


def test_missing_ids_are_reported_as_absent(tmp_path):
    info = read_draft_info(write(tmp_path, "specforge", ids=None))
    assert all(v is None for v in info.stated_ids.values())


def test_embeddings_taken_from_the_target(tmp_path):
    state = random_state(embeddings=False)
    folder = write(tmp_path, "vllm", state)
    draft = load_draft(folder)
    assert not draft.info.has_embeddings
    slots, ids = inputs()
    with pytest.raises(BadInput, match="no token embeddings"):
        draft.step(draft.fuse(slots), ids)
    from safetensors.torch import save_file

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    emb = torch.randn(V, H)
    save_file({"model.embed_tokens.weight": emb}, str(target / "model.safetensors"))
    draft = load_draft(folder, target=target)
    assert torch.equal(draft.embed_tokens.weight, emb)
    with torch.no_grad():
        logits, _ = draft.step(draft.fuse(slots), ids)
    assert torch.isfinite(logits[:, torch.arange(VD) + state["d2t"]]).all()
    save_file({"model.embed_tokens.weight": torch.randn(V, 2 * H)}, str(target / "model.safetensors"))
    with pytest.raises(BadInput, match=r"target embeddings are \[50, 64\]"):
        load_draft(folder, target=target)


# -- bad files ----------------------------------------------------------------------------


def test_bad_folders_are_bad_input(tmp_path):
    with pytest.raises(BadInput, match="not a draft folder"):
        load_draft(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInput, match="no config.json"):
        load_draft(tmp_path / "empty")
    folder = write(tmp_path, "specforge")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(BadInput, match=r"config.json:1:2: invalid JSON"):
        load_draft(folder)
    folder = write(tmp_path, "specforge", name="garbage")
    (folder / "model.safetensors").write_bytes(b"\x00" * 40)
    with pytest.raises(BadInput):
        load_draft(folder)


def test_missing_or_misshapen_tensors_are_bad_input(tmp_path):
    state = random_state()
    del state["midlayer.mlp.up_proj.weight"]
    with pytest.raises(BadInput, match="missing tensor 'midlayer.mlp.up_proj.weight'"):
        load_draft(write(tmp_path, "specforge", state))
    state = random_state()
    state["midlayer.mlp.up_proj.weight"] = torch.zeros(INTER + 1, H)
    with pytest.raises(BadInput, match=r"up_proj.weight is \[49, 32\]"):
        load_draft(write(tmp_path, "specforge", state, name="shape"))
    state = random_state()
    state["fc.weight"] = torch.zeros(H, 2 * H + 1)
    with pytest.raises(BadInput, match="fc.weight is"):
        load_draft(write(tmp_path, "specforge", state, name="fc"))
    state = random_state()
    state["midlayer.extra.weight"] = torch.zeros(3)
    with pytest.raises(BadInput, match="unexpected tensor 'midlayer.extra.weight'"):
        load_draft(write(tmp_path, "specforge", state, name="extra"))


def test_pickle_weights_load_only_tensors(tmp_path):
    folder = write(tmp_path, "specforge")
    (folder / "model.safetensors").unlink()
    torch.save({"fc.weight": torch.zeros(2, 2), "x": {"not": "a tensor"}}, folder / "pytorch_model.bin")
    with pytest.raises(BadInput, match="not a state dict of tensors"):
        load_draft(folder)


def test_unknown_layout_and_dflash(tmp_path):
    folder = tmp_path / "weird"
    write_checkpoint(folder, "specforge", {"hidden_size": H}, {"something.weight": torch.zeros(2)})
    with pytest.raises(BadInput, match="not an EAGLE-3 draft in a known layout"):
        load_draft(folder)
    from safetensors.torch import save_file

    dflash = tmp_path / "dflash"
    dflash.mkdir()
    (dflash / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "hidden_size": H, "vocab_size": V, "num_attention_heads": HEADS,
        "dflash_config": {"target_layer_ids": [1, 4, 7, 10, 13], "block_size": 16, "mask_token_id": 3}}))
    save_file({"fc.weight": torch.zeros(H, 5 * H), "hidden_norm.weight": torch.ones(H)}, str(dflash / "model.safetensors"))
    info = read_draft_info(dflash)
    assert (info.layout, info.kind, info.n_slots) == ("zlab-dflash", "dflash", 5)
    assert info.stated_ids["dflash_config.target_layer_ids"] == [1, 4, 7, 10, 13]
    with pytest.raises(BadInput, match="DFlash"):
        load_draft(dflash)


# -- the forward against transformers' own modules -----------------------------------------


def _transformers_midlayer(draft, emb, h):
    """The same decoder layer built from transformers' LlamaAttention (2H input; its o_proj
    padded to 2H outputs with zeros), LlamaMLP and LlamaRMSNorm, with the draft's weights."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaAttention,
        LlamaMLP,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
    )

    d = H // HEADS
    wide = LlamaConfig(hidden_size=2 * H, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=d,
                       intermediate_size=INTER, rms_norm_eps=1e-6, rope_theta=10000.0, attn_implementation="eager")
    narrow = LlamaConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=d,
                         intermediate_size=INTER, rms_norm_eps=1e-6, hidden_act="silu")
    sd = draft.state_dict()
    attn = LlamaAttention(wide, layer_idx=0).eval()
    with torch.no_grad():
        for p in ("q_proj", "k_proj", "v_proj"):
            getattr(attn, p).weight.copy_(sd[f"midlayer.self_attn.{p}.weight"])
        attn.o_proj.weight.zero_()
        attn.o_proj.weight[:H].copy_(sd["midlayer.self_attn.o_proj.weight"])
    mlp = LlamaMLP(narrow)
    mlp.load_state_dict({k.split("mlp.")[1]: v for k, v in sd.items() if k.startswith("midlayer.mlp.")})
    norms = {}
    for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        norms[n] = LlamaRMSNorm(H, eps=1e-6)
        norms[n].weight.data.copy_(sd[f"midlayer.{n}.weight"])
    T = h.shape[0]
    x = torch.cat((norms["input_layernorm"](emb), norms["hidden_norm"](h)), -1)[None]
    pos = torch.arange(T)[None]
    cos_sin = LlamaRotaryEmbedding(wide)(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    out, _ = attn(x, position_embeddings=cos_sin, attention_mask=mask)
    y = h + out[0, :, :H]
    return y + mlp(norms["post_attention_layernorm"](y))


@pytest.mark.slow  # ~9 s: importing transformers' Llama modules
def test_forward_matches_transformers_modules(tmp_path):
    draft = load_draft(write(tmp_path, "specforge"))
    slots, ids = inputs(T=11)
    with torch.no_grad():
        fused = draft.fuse(slots)
        assert torch.allclose(fused, torch.cat(slots, -1) @ draft.fc.weight.T, atol=1e-6)
        logits, hidden = draft.step(fused, ids)
        emb = draft.embed_tokens(ids)
        expected = _transformers_midlayer(draft, emb, fused)
        assert torch.allclose(hidden, expected, atol=1e-5), (hidden - expected).abs().max()
        normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6) * draft.norm.weight
        assert torch.allclose(logits[:, torch.arange(VD) + draft.d2t], normed @ draft.lm_head.weight.T, atol=1e-5)
        # a chain's first step with a cache is the lone step
        logits_c, hidden_c = draft.step(fused, ids, DraftCache())
        assert torch.allclose(hidden_c, hidden, atol=1e-6)
        # a batch of two gives each sequence's own result
        batch_logits, batch_hidden = draft.step(torch.stack([fused, fused.flip(0)]), torch.stack([ids, ids.flip(0)]))
        assert torch.allclose(batch_hidden[0], hidden, atol=1e-6)
        assert torch.allclose(batch_logits[1], draft.step(fused.flip(0), ids.flip(0))[0], atol=1e-5)


def test_second_step_attends_causally_to_step_one_and_to_itself_only(tmp_path):
    """Step 2 at position t: keys of step 1 at positions <= t, plus its own key at t (SpecForge's
    cache_hidden attention), RoPE position t + 1. Checked against a per-position loop."""
    draft = load_draft(write(tmp_path, "specforge"))
    slots, ids = inputs(T=7)
    attn = draft.midlayer.self_attn
    with torch.no_grad():
        fused = draft.fuse(slots)
        cache = DraftCache()
        _, h1 = draft.step(fused, ids, cache)
        ids2 = torch.roll(ids, -1)
        _, h2 = draft.step(h1, ids2, cache)
        layer = draft.midlayer
        x = torch.cat((layer.input_layernorm(draft.embed_tokens(ids2)), layer.hidden_norm(h1)), -1)
        d = H // HEADS
        q = attn._rope(attn.q_proj(x).view(7, HEADS, d).transpose(0, 1), torch.arange(7) + 1)
        k2 = attn._rope(attn.k_proj(x).view(7, KV, d).transpose(0, 1), torch.arange(7) + 1).repeat_interleave(2, 0)
        v2 = attn.v_proj(x).view(7, KV, d).transpose(0, 1).repeat_interleave(2, 0)
        k1, v1 = cache.keys[0][0], cache.values[0][0]
        rows = []
        for t in range(7):
            keys = torch.cat([k1[:, : t + 1], k2[:, t:t + 1]], 1)
            vals = torch.cat([v1[:, : t + 1], v2[:, t:t + 1]], 1)
            w = torch.softmax((q[:, t:t + 1] @ keys.transpose(1, 2)) / d ** 0.5, -1)
            rows.append((w @ vals)[:, 0].reshape(-1))
        y = h1 + attn.o_proj(torch.stack(rows))
        expected = y + layer.mlp(layer.post_attention_layernorm(y))
        assert torch.allclose(h2, expected, atol=1e-5)


def test_teacher_forced_alignment(tmp_path):
    draft = load_draft(write(tmp_path, "specforge"))
    slots, ids = inputs(T=10)
    with torch.no_grad():
        fused = draft.fuse(slots)
        guesses = teacher_forced(draft, fused, ids, 3)
        logits, _ = draft.step(fused, torch.cat([ids[1:], ids[:1] * 0]))
    assert [g.shape[0] for g in guesses] == [9, 8, 7]
    assert torch.equal(guesses[0], logits[:9].argmax(-1))


def test_rename_refuses_unknown_layout():
    with pytest.raises(BadInput):
        rename_for("zlab-dflash", random_state())


def test_speculators_dflash_config_is_read(tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "sdflash"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"], "block_size": 8,
        "aux_hidden_state_layer_ids": [2, 5], "draft_vocab_size": VD,
        "transformer_layer_config": {"model_type": "qwen3", "hidden_size": H, "vocab_size": V,
                                     "num_attention_heads": HEADS}}))
    save_file({"fc.weight": torch.zeros(H, 2 * H)}, str(folder / "model.safetensors"))
    info = read_draft_info(folder)
    assert (info.layout, info.kind, info.n_slots, info.draft_vocab_size) == ("speculators-dflash", "dflash", 2, VD)
    assert info.stated_ids["aux_hidden_state_layer_ids"] == [2, 5]
    assert "not modelled" in info.notes[0]


def test_the_speculators_config_carries_what_speculators_requires():
    """speculators 0.9.0's SpeculatorsConfig (``speculators/config.py``) requires ``proposal_methods``
    (holding the default method) and ``verifier`` (a null path allowed); without them its loader
    refuses the config (found by scripts/check-speculators-parity)."""
    cfg = config_for("speculators", hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV,
                     intermediate_size=INTER, vocab_size=V, draft_vocab_size=VD, ids=[1, 3, 5],
                     verifier="/models/target", steps=4)
    sc = cfg["speculators_config"]
    assert sc["default_proposal_method"] in [m["proposal_type"] for m in sc["proposal_methods"]]
    assert sc["proposal_methods"][0]["speculative_tokens"] == 4
    assert sc["verifier"] == {"name_or_path": "/models/target", "architectures": ["LlamaForCausalLM"]}
    bare = config_for("speculators", hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV,
                      intermediate_size=INTER, vocab_size=V, draft_vocab_size=VD, ids=None)
    assert bare["speculators_config"]["verifier"]["name_or_path"] is None


def test_the_kl_to_the_draft_is_finite_where_the_target_rules_a_token_out():
    """A target log-probability of -inf (a masked vocabulary entry) contributes 0, not NaN; a token
    the draft rules out costs a bounded amount (the floor)."""
    from surgeon.draft.behaviour import LOG_FLOOR, kl_to_draft

    target = torch.log_softmax(torch.tensor([[2.0, 1.0, float("-inf")]]), -1)
    same = torch.tensor([[2.0, 1.0, -1e4]])
    assert torch.isfinite(kl_to_draft(target, same)).all() and float(kl_to_draft(target, same)) < 1e-6
    ruled_out = torch.tensor([[2.0, float("-inf"), 0.0]])
    got = float(kl_to_draft(target, ruled_out))
    assert 0 < got <= -LOG_FLOOR
