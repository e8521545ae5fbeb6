"""Draft checkpoint layouts: which tool wrote a draft folder, and its tensors under one set of names.

The canonical names are SpecForge's (``LlamaForCausalLMEagle3``, read in
sgl-project/SpecForge ``specforge/modeling/draft/llama3_eagle.py:1654-1699``): ``fc.weight``,
``midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, hidden_norm, input_layernorm,
post_attention_layernorm}.weight``, ``norm.weight``, ``lm_head.weight``, ``embed_tokens.weight``
(optional: engines then share the target's), ``fc_norm.{i}.weight`` (optional), ``d2t`` (draft id
-> target id *offset*) and ``t2d`` (target-vocab bool mask).

Layouts read here, each with where its names were read:

* ``specforge``: the names above, ``config.json`` with ``architectures: [LlamaForCausalLMEagle3]``
  and ``eagle_config.eagle_aux_hidden_state_layer_ids``.
* ``speculators``: ``layers.0.*`` for ``midlayer.*`` (vllm-project/speculators
  ``src/speculators/convert/eagle/eagle3_converter.py``, "Remap midlayer.* to layers.0.*"),
  ``input_norm.weight`` for ``norm_before_fc``; ``config.json`` with ``speculators_model_type:
  eagle3``, the decoder in ``transformer_layer_config`` and the ids top-level
  (``src/speculators/models/eagle3/config.py``).
* ``vllm``: the engine's own module names (``model.layers.0.self_attn.qkv_proj`` stacked q/k/v,
  ``model.layers.0.mlp.gate_up_proj``, ``model.fc``, ``model.norm``, ``draft_id_to_target_id`` for
  ``d2t``), read in vllm 0.33.0 ``vllm/model_executor/models/llama_eagle3.py:290-299`` (the
  ``midlayer.`` -> ``layers.0.`` mapper and the stacked q/k/v, gate/up) and ``:427-440`` (``d2t`` ->
  ``draft_id_to_target_id``, ``model.`` prefix). SGLang's module names are the same
  (``sglang/srt/models/llama_eagle3.py`` ``load_weights``: stacked ``qkv_proj``/``gate_up_proj``,
  ``model.`` prefix); a folder is called ``sglang`` only when it has SGLang's legacy
  ``aux_norm_{low,mid,high}`` names (mapped to ``fc_norm.{0,1,2}`` there).
* ``zlab-dflash`` / ``speculators-dflash``: DFlash drafts: only their config
  (``dflash_config.target_layer_ids``, ``block_size``, ``mask_token_id``; speculators'
  ``aux_hidden_state_layer_ids``) and ``fc`` are read; their forward is not modelled here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from surgeon.capture.tensorfiles import read_safetensors
from surgeon.core.errors import BadInput
from surgeon.core.safefile import open_regular
from surgeon.wiring.draft import read_config, read_ids

EAGLE3_LAYOUTS = ("specforge", "speculators", "vllm", "sglang")
DFLASH_LAYOUTS = ("zlab-dflash", "speculators-dflash")
LAYOUTS = EAGLE3_LAYOUTS + DFLASH_LAYOUTS

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_LAYER_NORMS = ("hidden_norm", "input_layernorm", "post_attention_layernorm")
REQUIRED = (
    ["fc.weight", "norm.weight", "lm_head.weight"]
    + [f"midlayer.self_attn.{p}.weight" for p in _PROJ]
    + [f"midlayer.mlp.{p}.weight" for p in _MLP]
    + [f"midlayer.{n}.weight" for n in _LAYER_NORMS]
)
_SGLANG_LEGACY = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}


@dataclass
class Checkpoint:
    """A draft folder as read: its config, layout and tensors under the canonical names."""

    path: Path
    config_path: Path
    config: dict[str, Any]
    layout: str
    kind: str  # "eagle3" | "dflash"
    tensors: dict[str, torch.Tensor]
    notes: list[str] = field(default_factory=list)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            part, _ = read_safetensors(f)
            tensors.update(part)
        return tensors
    bins = sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))
    if not bins:
        raise BadInput(f"{folder}: no *.safetensors or *.bin weights in the draft folder")
    for f in bins:
        fd = open_regular(f, what="the weights file")  # a FIFO is refused, never waited on
        try:
            with os.fdopen(fd, "rb") as handle:
                part = torch.load(handle, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle errors of every kind
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise BadInput(f"{f}: not a readable weights file ({first})") from None
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise BadInput(f"{f}: not a state dict of tensors")
        tensors.update(part)
    return tensors


def detect_layout(config: dict[str, Any], keys: set[str]) -> str:
    """The layout of a draft from its config and tensor names (see the module docstring)."""
    smt = config.get("speculators_model_type")
    if smt == "dflash":
        return "speculators-dflash"
    if smt == "eagle3":
        return "speculators"
    if smt is not None:
        raise BadInput(f"speculators_model_type {smt!r} is not an EAGLE-3 or DFlash draft")
    archs = config.get("architectures") or []
    if isinstance(config.get("dflash_config"), dict) or any("dflash" in str(a).lower() for a in archs):
        return "zlab-dflash"
    if any(k.startswith("midlayer.") for k in keys):
        return "specforge"
    if any(legacy in k for k in keys for legacy in _SGLANG_LEGACY):
        return "sglang"
    if any(k.startswith(("model.layers.0.", "layers.0.")) for k in keys):
        return "vllm"
    raise BadInput("no EAGLE-3 decoder layer weights (midlayer.*, layers.0.* or model.layers.0.*): "
                   "not an EAGLE-3 draft in a known layout")


def _unstack(name: str, t: torch.Tensor, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """vLLM/SGLang stacked parameters back to their parts (the engines' stacking mapping)."""
    if name.endswith("self_attn.qkv_proj.weight"):
        q, kv = sizes["q"], sizes["kv"]
        if t.shape[0] != q + 2 * kv:
            raise BadInput(f"{name} has {t.shape[0]} rows, expected q {q} + 2 x kv {kv}")
        base = name[: -len("qkv_proj.weight")]
        return {base + "q_proj.weight": t[:q], base + "k_proj.weight": t[q:q + kv],
                base + "v_proj.weight": t[q + kv:]}
    if name.endswith("mlp.gate_up_proj.weight"):
        half = t.shape[0] // 2
        base = name[: -len("gate_up_proj.weight")]
        return {base + "gate_proj.weight": t[:half], base + "up_proj.weight": t[half:]}
    return {name: t}


def canonical(layout: str, tensors: dict[str, torch.Tensor], sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """``tensors`` under SpecForge's names (module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        n = name
        for legacy, new in _SGLANG_LEGACY.items():
            n = n.replace(legacy, new)
        if n == "draft_id_to_target_id":
            n = "d2t"
        if n.startswith("model."):
            n = n[len("model."):]
        if n.startswith("layers.0."):
            n = "midlayer." + n[len("layers.0."):]
        elif n.startswith("layers."):
            raise BadInput(f"tensor {name!r}: a second draft decoder layer; only one-layer EAGLE-3 drafts are modelled")
        out.update(_unstack(n, t, sizes))
    return out


def layer_fields(layout: str, config: dict[str, Any]) -> dict[str, Any]:
    """The decoder layer's config (speculators nests it in ``transformer_layer_config``)."""
    if layout in ("speculators", "speculators-dflash"):
        inner = config.get("transformer_layer_config")
        if not isinstance(inner, dict):
            raise BadInput("speculators config has no transformer_layer_config object")
        merged = dict(inner)
        for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc",
                    "fc_norm", "norm_output"):
            if key in config:
                merged[key] = config[key]
        return merged
    return config


def stated_ids(cfg: Path, config: dict[str, Any]) -> dict[str, list[int] | None]:
    """Every id list the config states, key -> ids as written (None: absent). The keys of
    ``surgeon check-draft`` (``surgeon/wiring/draft.py`` ``read_ids``), plus speculators DFlash's
    ``aux_hidden_state_layer_ids`` when present."""
    ids = read_ids(cfg, config)
    if "aux_hidden_state_layer_ids" in config:
        value = config["aux_hidden_state_layer_ids"]
        if value is not None and (not isinstance(value, list) or not all(type(v) is int for v in value)):
            raise BadInput(f"{cfg}: aux_hidden_state_layer_ids must be a list of integers")
        ids["aux_hidden_state_layer_ids"] = value
    return ids


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read a draft folder (``config.json`` + safetensors or ``torch.load(weights_only=True)`` weights)."""
    folder = Path(path)
    if not folder.is_dir():
        raise BadInput(f"{folder}: not a draft folder (expected config.json and weights)")
    cfg, config = read_config(folder)
    tensors = _read_tensors(folder)
    layout = detect_layout(config, set(tensors))
    kind = "dflash" if layout in DFLASH_LAYOUTS else "eagle3"
    return Checkpoint(path=folder, config_path=cfg, config=config, layout=layout, kind=kind, tensors=tensors)


# -- writing (tests and the synthetic fixtures write every layout with its real names) ---------


def _stack_for_engine(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    attn, mlp = "midlayer.self_attn.", "midlayer.mlp."
    for name, t in state.items():
        if name.startswith(attn) and name[len(attn):].split(".")[0] in ("q_proj", "k_proj", "v_proj"):
            continue
        if name.startswith(mlp) and name[len(mlp):].split(".")[0] in ("gate_proj", "up_proj"):
            continue
        out[name] = t
    out[attn + "qkv_proj.weight"] = torch.cat([state[attn + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")])
    out[mlp + "gate_up_proj.weight"] = torch.cat([state[mlp + p + ".weight"] for p in ("gate_proj", "up_proj")])
    return out


def rename_for(layout: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical (SpecForge) names -> the names ``layout`` writes."""
    if layout == "specforge":
        return dict(state)
    if layout == "speculators":
        return {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v for k, v in state.items()}
    if layout in ("vllm", "sglang"):
        out = {}
        for k, v in _stack_for_engine(state).items():
            if k == "t2d":
                continue
            if k == "d2t":
                out["draft_id_to_target_id" if layout == "vllm" else "d2t"] = v
                continue
            if layout == "sglang" and k.startswith("fc_norm."):
                k = {"fc_norm.0": "aux_norm_low", "fc_norm.1": "aux_norm_mid", "fc_norm.2": "aux_norm_high"}[k[:9]] + k[9:]
            k = "model." + ("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k)
            out[k if not k.startswith("model.lm_head") else k[len("model."):]] = v
        return out
    raise BadInput(f"layout {layout!r} cannot be written (one of {', '.join(EAGLE3_LAYOUTS)})")


def write_checkpoint(folder: str | Path, layout: str, config: dict[str, Any], state: dict[str, torch.Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` with ``layout``'s real key names."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in rename_for(layout, state).items()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def config_for(layout: str, *, hidden_size: int, num_attention_heads: int, num_key_value_heads: int,
               intermediate_size: int, vocab_size: int, draft_vocab_size: int, ids: list[int] | None,
               target_hidden_size: int | None = None, rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0,
               max_position_embeddings: int = 2048, verifier: str | None = None,
               steps: int = 3) -> dict[str, Any]:
    """A ``config.json`` as ``layout``'s tool writes it (``ids=None``: no id list at all). For
    speculators: the ``speculators_config`` its own converter writes, whose ``proposal_methods`` and
    ``verifier`` its loader requires (speculators 0.9.0 ``config.py``: a ``null`` verifier path is
    allowed; ``verifier`` names the target's folder); ``steps`` is the greedy proposal's length."""
    layer = {"hidden_size": hidden_size, "num_attention_heads": num_attention_heads,
             "num_key_value_heads": num_key_value_heads, "intermediate_size": intermediate_size,
             "vocab_size": vocab_size, "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta,
             "max_position_embeddings": max_position_embeddings, "hidden_act": "silu", "num_hidden_layers": 1,
             "head_dim": hidden_size // num_attention_heads}
    if layout == "speculators":
        cfg: dict[str, Any] = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                               "transformer_layer_config": {**layer, "model_type": "llama"},
                               "draft_vocab_size": draft_vocab_size, "norm_before_residual": False,
                               "speculators_config": {
                                   "algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps}],
                                   "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}}}
        if ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(ids)
    else:
        arch = "LlamaForCausalLMEagle3"
        cfg = {**layer, "architectures": [arch], "model_type": "llama", "draft_vocab_size": draft_vocab_size,
               "tie_word_embeddings": False}
        if ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True}
    if target_hidden_size is not None:
        cfg["target_hidden_size"] = target_hidden_size
    return cfg
