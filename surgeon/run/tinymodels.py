"""Tiny random-weight transformers models, for tests and demonstrations.

:func:`make_tiny_model` writes a real ``save_pretrained`` folder (``config.json`` +
``model.safetensors``) for one of :data:`FAMILIES`, with seeded, deterministic weights and no
network access: what :func:`surgeon.verify.reference.capture_reference` (and, later, an engine) loads.

Sizes are tiny but chosen to stay loadable by the engines where that is cheap:

* attention ``head_dim`` is 64 (vLLM's CPU attention refuses 16); 2 query heads, 1 KV head;
* ``deepseek_v3`` (the Kimi-K2.5 family: MLA + MoE) keeps the MLA dimensions vLLM accepts
  (``kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128``), 4 routed
  experts, 2 per token, 1 shared expert, layer 0 dense (``first_k_dense_replace=1``) and
  ``topk_method="noaux_tc", scoring_func="sigmoid"``. About 1.5 MB per layer in float32
  (12 MB at 8 layers, 92 MB at 61; half that in bfloat16). vLLM takes this family in bfloat16
  only.

``residual_scale`` multiplies every residual branch's output projection (attention
``o_proj``; MLP, routed-expert and shared-expert ``down_proj``) so that consecutive
``layer_out`` states differ by a few percent, as in real deep models, instead of the ~45-70%
a random initialisation gives. :data:`GAP_SCALES` lists values measured to land the median
adjacent-layer gap (:func:`surgeon.verify.reference.adjacent_layer_gap`) in 1-3%.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from surgeon.core.errors import BadInput

FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "deepseek_v3")

#: ``residual_scale`` values that give a median adjacent-layer gap of about 2% (measured
#: 1.5-2.7% with the default sizes, seeds 0-3, 4, 8 and 61 layers; tests/test_reference.py
#: asserts 1-3%). Without scaling the gap is 45-70%. The gap is close to linear in the scale
#: below ~0.1 (DeepSeek-V3's MoE, with ``routed_scaling_factor`` 2.5, needs ~4x less).
GAP_SCALES: dict[str, float] = {
    "llama": 0.025,
    "qwen2": 0.025,
    "qwen3": 0.02,
    "mistral": 0.025,
    "deepseek_v3": 0.006,
}

_DTYPES = ("float32", "bfloat16", "float16")
_HEAD_DIM = 64
_VOCAB = 320
_INTERMEDIATE = 128


def _config_kwargs(family: str, num_layers: int, hidden_size: int, dtype: str) -> dict[str, Any]:
    common: dict[str, Any] = dict(
        vocab_size=_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=_INTERMEDIATE,
        num_hidden_layers=num_layers,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        dtype=dtype,
    )
    if family == "deepseek_v3":
        common.update(
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=64,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=_INTERMEDIATE // 2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            num_nextn_predict_layers=0,  # no MTP weights are written
        )
    else:
        common.update(num_attention_heads=2, num_key_value_heads=1, head_dim=_HEAD_DIM)
    if family == "mistral":
        common.update(sliding_window=None)
    return common


def tiny_config(family: str, *, num_layers: int = 4, hidden_size: int = 64, dtype: str = "float32"):
    """The transformers config :func:`make_tiny_model` uses (no weights)."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise BadInput(f"unknown tiny-model family {family!r}: expected one of {', '.join(FAMILIES)}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise BadInput(f"num_layers must be a positive integer, not {num_layers!r}")
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 8 or hidden_size % 2:
        raise BadInput(f"hidden_size must be an even integer >= 8, not {hidden_size!r}")
    if dtype not in _DTYPES:
        raise BadInput(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype!r}")
    return AutoConfig.for_model(family, **_config_kwargs(family, num_layers, hidden_size, dtype))


def scale_residual_branches(model, factor: float) -> int:
    """Multiply, in place, the output projection of every residual branch of every decoder
    layer (``o_proj`` and ``down_proj``, weights and biases, dense, routed experts and shared
    experts alike) by ``factor``. Returns how many tensors were scaled."""
    import torch

    layers = model.model.layers
    n = 0
    with torch.no_grad():
        for layer in layers:
            for name, param in layer.named_parameters():
                parts = name.split(".")
                if "o_proj" in parts or "down_proj" in parts:
                    param.mul_(factor)
                    n += 1
    return n


def _cast(model, dtype) -> None:
    """Cast floating parameters and buffers to ``dtype`` in place, leaving in float32 those that
    transformers itself keeps in float32 (``_keep_in_fp32_modules[_strict]``, e.g. DeepSeek-V3's
    router ``gate.weight`` and ``e_score_correction_bias``), as ``from_pretrained`` would. The
    weights of a bfloat16 model are thus its float32 twin's, rounded."""
    import torch

    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and not any(k in name for k in keep):
                t.data = t.data.to(dtype)
    model.config.dtype = dtype


def make_tiny_model(
    family: str,
    out_dir: str | Path,
    *,
    num_layers: int = 4,
    hidden_size: int = 64,
    seed: int = 0,
    residual_scale: float | None = None,
    dtype: str = "float32",
) -> Path:
    """Build a tiny random ``family`` model (``llama``, ``qwen2``, ``qwen3``, ``mistral``,
    ``deepseek_v3``), ``save_pretrained`` it (safetensors) into ``out_dir`` and return
    ``out_dir``. Same arguments, same bytes of weights; the caller's torch RNG is untouched."""
    import torch
    from transformers import AutoModelForCausalLM

    from surgeon.verify.reference import quiet_transformers

    config = tiny_config(family, num_layers=num_layers, hidden_size=hidden_size, dtype=dtype)
    if residual_scale is not None:
        if isinstance(residual_scale, bool) or not isinstance(residual_scale, (int, float)) or not residual_scale > 0:
            raise BadInput(f"residual_scale must be a positive number, not {residual_scale!r}")
    out = Path(out_dir)
    with torch.random.fork_rng(devices=[]), quiet_transformers():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if residual_scale is not None:
            scale_residual_branches(model, float(residual_scale))
        _cast(model, getattr(torch, dtype))
        model.eval()
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
    return out
