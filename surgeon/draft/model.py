"""An EAGLE-3 draft as a small torch module of our own, loaded from any layout in ``layouts``.

Why our own: ``speculators`` (vllm-project, PyPI) is the vLLM project's draft runtime, but its
0.9.0 wheel requires ``transformers<=5.19.0`` and pulls ``torchvision``/``torchaudio`` (its
METADATA ``Requires-Dist``), while surgeon pins transformers 5.24 (and those two break
``import transformers`` where PyPI's torchvision does not match the CPU torch build). So the forward below is written from
SpecForge's source (sgl-project/SpecForge ``specforge/modeling/draft/llama3_eagle.py``, cited by
line) and checked in ``tests/draft/test_model.py`` against transformers' own Llama attention, MLP
and RMSNorm with the same weights.

The forward, as SpecForge trains it:

* ``fuse``: ``fc(cat(slot_0, ..., slot_{n-1}))`` (``project_hidden_states``, :1762-1770), with the
  optional per-slot ``fc_norm`` (:1679-1687, :1764-1769) and vLLM/SGLang's ``norm_before_fc``.
* ``step``: one decoder layer whose attention input is ``cat(input_layernorm(embed),
  hidden_norm(h))`` of width 2H (``LlamaDecoderLayer.forward`` :1598-1651, q/k/v of width 2H
  :556-566); the residual is ``h`` *before* ``hidden_norm`` (:1625; vLLM's ``norm_before_residual``
  option keeps the normed one). The output (before the final norm) is what steps 2+ feed back
  (``backbone`` :1779-1797 returns it and ``algorithms/eagle3/model.py`` sets ``hidden_states =
  hidden_states_out``); logits are ``lm_head(norm(h))`` (``compute_logits`` :1772-1777).
* Alignment: SpecForge shifts ``input_ids`` left by one before step 1
  (``modeling/target/target_head.py:103-107``, ``utils.py:129-135`` ``padding(left=False)``), so
  the hidden state of token ``t`` is paired with the embedding of token ``t+1`` and the label is
  the target's greedy next token after ``t+1``; each further step shifts ``input_ids`` again
  (``algorithms/eagle3/model.py`` step 5.7) and the labels by one more (``core/eagle3_adapters.py``
  ``target_p_padded[:, idx: idx + seq_length]``). ``step`` takes ``input_ids`` ALREADY aligned:
  ``input_ids[t]`` is embedded next to ``fused[t]``; :func:`teacher_forced` does the shifting.
* Steps 2+ attend to step 1's keys causally and to their own earlier steps' keys at the same
  position only (``LlamaAttention.forward`` with ``cache_hidden``, :714-760), with RoPE positions
  ``t + step`` (``position_ids + lck``).

Not modelled (refused or noted, never silently run): more than one draft decoder layer, DFlash
forwards (their config and fc are read into :class:`DraftInfo`), sliding-window draft attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surgeon.core.errors import BadInput
from surgeon.draft.layouts import REQUIRED, Checkpoint, canonical, layer_fields, read_checkpoint, stated_ids
from surgeon.verify.reference import require_finite


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread for the duration (tiny matrices: a second thread only contends)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class DraftInfo:
    """What the checkpoint says about itself (accept reports it as its ``draft_info``, field by field)."""

    path: str
    layout: str  # "specforge" | "speculators" | "vllm" | "sglang" | "zlab-dflash" | "speculators-dflash"
    kind: str  # "eagle3" | "dflash"
    hidden_size: int
    n_slots: int
    target_vocab_size: int
    draft_vocab_size: int
    stated_ids: dict[str, list[int] | None]
    target_hidden_size: int = 0  # fc slot width (the target's hidden size); 0 given: hidden_size
    has_embeddings: bool = True
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.target_hidden_size:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` in float32 (llama3_eagle.py:1552-1567)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


@dataclass
class DraftCache:
    """Keys and values of the earlier draft steps (SpecForge's ``cache_hidden``)."""

    keys: list[torch.Tensor] = field(default_factory=list)  # each [heads, T, d] (after RoPE, repeated)
    values: list[torch.Tensor] = field(default_factory=list)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, rope_theta: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)  # llama3_eagle.py:556-566
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return x * emb.cos()[None] + rotate_half(x) * emb.sin()[None]

    def forward(self, x: torch.Tensor, cache: DraftCache | None) -> torch.Tensor:
        """``x`` [T, 2H] or [B, T, 2H] -> [T, H] / [B, T, H]."""
        lone = x.dim() == 2
        if lone:
            x = x[None]
        B, T = x.shape[0], x.shape[1]
        step = len(cache.keys) if cache is not None else 0
        pos = torch.arange(T, device=x.device) + step  # position_ids + lck
        q = self._rope(self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2), pos)
        k = self._rope(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2), pos)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if cache is not None:
            cache.keys.append(k)
            cache.values.append(v)
        keys = cache.keys if cache is not None else [k]
        values = cache.values if cache is not None else [v]
        scale = self.head_dim ** -0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        first = (q @ keys[0].transpose(-1, -2)) * scale
        first = first.masked_fill(~causal, float("-inf"))
        diag = [((q * ki).sum(-1) * scale)[..., None] for ki in keys[1:]]  # same position only
        weights = torch.softmax(torch.cat([first, *diag], dim=-1), dim=-1)
        out = weights[..., :T] @ values[0]
        for i, vi in enumerate(values[1:]):
            out = out + weights[..., T + i:T + i + 1] * vi
        out = self.o_proj(out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))
        return out[0] if lone else out


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    """SpecForge's ``LlamaDecoderLayer`` (llama3_eagle.py:1570-1651)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = _Attention(H, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                                    cfg["rope_theta"])
        self.mlp = SwiGLU(H, cfg["intermediate_size"])
        self.hidden_norm = RMSNorm(H, eps)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.norm_before_residual = bool(cfg.get("norm_before_residual", False))

    def forward(self, emb: torch.Tensor, h: torch.Tensor, cache: DraftCache | None) -> torch.Tensor:
        normed = self.hidden_norm(h)
        residual = normed if self.norm_before_residual else h  # vLLM llama_eagle3.py:110-122
        x = torch.cat((self.input_layernorm(emb), normed), dim=-1)  # :1627-1630
        x = residual + self.self_attn(x, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Draft(nn.Module):
    """An EAGLE-3 draft: ``fuse`` the target's slots, then ``step`` (module docstring)."""

    def __init__(self, info: DraftInfo, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.info = info
        H, Ht, n = info.hidden_size, info.target_hidden_size or info.hidden_size, info.n_slots
        eps = cfg["rms_norm_eps"]
        self.fc = nn.Linear(n * Ht, H, bias=False)
        self.fc_norm = nn.ModuleList([RMSNorm(Ht, eps) for _ in range(n)]) if cfg.get("fc_norm") else None
        self.input_norm = RMSNorm(n * Ht, eps) if cfg.get("norm_before_fc") else None
        self.embed_tokens: nn.Embedding | None = (
            nn.Embedding(info.target_vocab_size, H) if info.has_embeddings else None)
        self.midlayer = _MidLayer(cfg)
        self.norm = RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, info.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(info.draft_vocab_size, dtype=torch.int64))
        self.logits_norm = bool(cfg.get("_logits_norm", True))
        self.feedback_normed = bool(cfg.get("_feedback_normed", False))

    def attach_embeddings(self, weight: torch.Tensor) -> None:
        """Use the target's token embeddings (what vLLM and SGLang do when the draft has none)."""
        V, H = self.info.target_vocab_size, self.info.hidden_size
        if tuple(weight.shape) != (V, H):
            raise BadInput(f"target embeddings are {list(weight.shape)}, the draft needs [{V}, {H}]")
        self.embed_tokens = nn.Embedding(V, H)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def fuse(self, slots: Sequence[torch.Tensor]) -> torch.Tensor:
        """``n_slots`` x [T, H_target] -> [T, H]: the fc over the concatenated slots."""
        if len(slots) != self.info.n_slots:
            raise BadInput(f"the draft's fc takes {self.info.n_slots} slots, got {len(slots)}")
        x = torch.cat(list(slots), dim=-1)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(self.info.n_slots, dim=-1), strict=True)], -1)
        return self.fc(x)

    def step(self, fused: torch.Tensor, input_ids: torch.Tensor,
             cache: DraftCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One teacher-forced draft forward over a sequence: ``fused[t]`` (the fc output at step 1,
        the previous step's hidden output at steps 2+) paired with the embedding of
        ``input_ids[t]`` (already aligned, module docstring). Returns logits over the TARGET
        vocabulary [T, V] (``d2t`` applied; tokens outside the draft vocabulary get -inf, as vLLM's
        ``compute_logits``) and the hidden output [T, H] that steps 2+ feed back. Pass one
        :class:`DraftCache` through all steps of a chain; ``None`` is a lone step 1."""
        if self.embed_tokens is None:
            raise BadInput(f"{self.info.path}: the draft has no token embeddings; give the target "
                           "(load_draft(path, target=DIR)) to take them from it, as the engines do")
        h = self.midlayer(self.embed_tokens(input_ids), fused, cache)
        normed = self.norm(h)
        logits = self.lm_head(normed if self.logits_norm else h)
        return self.to_target_vocab(logits), (normed if self.feedback_normed else h)

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        V, Vd = self.info.target_vocab_size, self.info.draft_vocab_size
        if Vd == V and not bool(self.d2t.any()):
            return logits
        full = logits.new_full((*logits.shape[:-1], V), float("-inf"))
        full[..., torch.arange(Vd, device=logits.device) + self.d2t] = logits  # d2t holds offsets
        return full


def chained_logits(draft: Eagle3Draft, fused: torch.Tensor, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The draft's logits for ``steps`` chained steps, SpecForge's alignment (module docstring).

    ``fused`` [T, H] is the fc output of the target's states at positions ``0..T-1`` of
    ``input_ids`` [T]. Entry ``j`` of the result is [T - 1 - j, V]: the draft's logits, at step
    ``j+1``, for token ``t + 2 + j`` of the chain that starts at position ``t`` (step 1 pairs state
    ``t`` with token ``t+1``; step ``j+1`` embeds token ``t+1+j``, teacher-forced)."""
    T = input_ids.shape[0]
    cache = DraftCache()
    h = fused
    out: list[torch.Tensor] = []
    for j in range(steps):
        if T - 1 - j <= 0:
            break
        ids = torch.zeros_like(input_ids)
        ids[: T - 1 - j] = input_ids[1 + j:]  # padding(input_ids, left=False), j+1 times
        logits, h = draft.step(h, ids, cache)
        out.append(logits[: T - 1 - j])
    return out


def teacher_forced(draft: Eagle3Draft, fused: torch.Tensor, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Greedy draft guesses for ``steps`` chained steps: the argmax of :func:`chained_logits`, entry
    ``j`` [T - 1 - j] token ids."""
    return [logits.argmax(-1) for logits in chained_logits(draft, fused, input_ids, steps)]


# -- loading ------------------------------------------------------------------------------


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadInput(f"draft config: {key} must be a positive integer, got {value!r}")
    return value


def _float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise BadInput(f"draft config: {key} must be a positive number, got {value!r}")
    return float(value)


def _layer_cfg(ck: Checkpoint) -> dict[str, Any]:
    raw = layer_fields(ck.layout, ck.config)
    H = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if rope_type not in ("default", None):
        raise BadInput(f"{ck.config_path}: rope type {rope_type!r} is not modelled (plain RoPE only)")
    if raw.get("sliding_window") and raw.get("use_sliding_window", True) and raw.get("layer_types"):
        raise BadInput(f"{ck.config_path}: sliding-window draft attention is not modelled")
    cfg = {
        "hidden_size": H, "num_attention_heads": heads,
        "num_key_value_heads": _int(raw, "num_key_value_heads", heads),
        "head_dim": _int(raw, "head_dim", H // heads) if raw.get("head_dim") is not None else H // heads,
        "intermediate_size": _int(raw, "intermediate_size"),
        "rms_norm_eps": _float(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        "rope_theta": _float(raw.get("rope_theta", rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0),
                             "rope_theta"),
        "vocab_size": _int(raw, "vocab_size"),
        "target_hidden_size": _int(raw, "target_hidden_size", H) if raw.get("target_hidden_size") else H,
        "norm_before_residual": bool(raw.get("norm_before_residual", False)),
        "norm_before_fc": bool(raw.get("norm_before_fc", (ck.config.get("eagle_config") or {}).get("norm_before_fc", False))),
        "fc_norm": bool(raw.get("fc_norm", False) or raw.get("use_aux_norm", False)),
    }
    norm_output = raw.get("norm_output")
    if ck.layout == "specforge":  # llama3_eagle.py:1690, :1773: logits from norm(h) unless norm_output is false
        cfg["_logits_norm"], cfg["_feedback_normed"] = norm_output is None or bool(norm_output), False
    else:  # vLLM llama_eagle3.py:252, :283-286: logits always normed; norm_output feeds back the normed state
        cfg["_logits_norm"], cfg["_feedback_normed"] = True, bool(norm_output)
    if norm_output is not None:
        ck.notes.append(f"norm_output={norm_output!r}: SpecForge reads it as 'norm before the LM head', vLLM/SGLang as "
                        f"'feed back the normed state'; modelled as {'SpecForge' if ck.layout == 'specforge' else 'vLLM'}")
    return cfg


def _info(ck: Checkpoint, cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> DraftInfo:
    fc = state.get("fc.weight")
    if fc is None or fc.dim() != 2:
        raise BadInput(f"{ck.path}: no 2-D fc.weight")
    H, Ht = cfg["hidden_size"], cfg["target_hidden_size"]
    if fc.shape[0] != H or fc.shape[1] % Ht:
        raise BadInput(f"{ck.path}: fc.weight is {list(fc.shape)}: expected [{H}, n x {Ht}]")
    lm = state.get("lm_head.weight")
    Vd = int(lm.shape[0]) if lm is not None else int(ck.config.get("draft_vocab_size") or cfg["vocab_size"])
    t2d = state.get("t2d")
    V = int(t2d.shape[0]) if t2d is not None else cfg["vocab_size"]
    return DraftInfo(path=str(ck.path), layout=ck.layout, kind=ck.kind, hidden_size=H, n_slots=fc.shape[1] // Ht,
                     target_vocab_size=V, draft_vocab_size=Vd, stated_ids=stated_ids(ck.config_path, ck.config),
                     target_hidden_size=Ht, has_embeddings="embed_tokens.weight" in state, notes=tuple(ck.notes))


def read_draft_info(path: str | Path) -> DraftInfo:
    """What any draft folder (EAGLE-3 or DFlash) says about itself, without building a forward."""
    ck = read_checkpoint(path)
    if ck.kind == "dflash":
        return _dflash_info(ck)
    cfg = _layer_cfg(ck)
    return _info(ck, cfg, canonical(ck.layout, ck.tensors, _sizes(cfg)))


def _dflash_info(ck: Checkpoint) -> DraftInfo:
    raw = layer_fields(ck.layout, ck.config)
    fc = next((t for k, t in ck.tensors.items() if k.removeprefix("model.").removeprefix("encoder.") == "fc.weight"), None)
    if fc is None or fc.dim() != 2:
        raise BadInput(f"{ck.path}: DFlash draft has no 2-D fc.weight")
    H = _int(raw, "hidden_size")
    Ht = int(raw.get("target_hidden_size") or H)
    if fc.shape[1] % Ht:
        raise BadInput(f"{ck.path}: fc.weight is {list(fc.shape)}, not n x {Ht} wide")
    V = _int(raw, "vocab_size")
    notes = ("DFlash: config and fc read; the draft forward (block diffusion) is not modelled here",)
    return DraftInfo(path=str(ck.path), layout=ck.layout, kind="dflash", hidden_size=H, n_slots=fc.shape[1] // Ht,
                     target_vocab_size=V, draft_vocab_size=int(raw.get("draft_vocab_size") or V),
                     stated_ids=stated_ids(ck.config_path, ck.config), target_hidden_size=Ht,
                     has_embeddings=any(k.endswith("embed_tokens.weight") for k in ck.tensors), notes=notes)


def dflash_fc(path: str | Path) -> torch.Tensor:
    """The fc weight [H, n x H_target] of a DFlash draft (for weight-space evidence)."""
    ck = read_checkpoint(path)
    for k, t in ck.tensors.items():
        if k.removeprefix("model.").removeprefix("encoder.") == "fc.weight":
            return t.float()
    raise BadInput(f"{ck.path}: no fc.weight")


def _sizes(cfg: dict[str, Any]) -> dict[str, int]:
    return {"q": cfg["num_attention_heads"] * cfg["head_dim"], "kv": cfg["num_key_value_heads"] * cfg["head_dim"]}


def load_draft(path: str | Path, *, target: str | Path | None = None) -> Eagle3Draft:
    """An EAGLE-3 draft from any layout (``layouts``), float32 on the CPU, eval mode. A draft
    without token embeddings takes the target's (``target``: its HF folder) as vLLM and SGLang do.
    Anything unreadable, missing or of the wrong shape is BadInput (one line)."""
    ck = read_checkpoint(path)
    if ck.kind == "dflash":
        raise BadInput(f"{ck.path}: a DFlash draft ({ck.layout}); its forward is not modelled (read_draft_info reads it)")
    cfg = _layer_cfg(ck)
    state = canonical(ck.layout, ck.tensors, _sizes(cfg))
    info = _info(ck, cfg, state)
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise BadInput(f"{ck.path}: missing tensor {missing[0]!r} ({ck.layout} layout)")
    require_finite(sorted(state.items()), f"{ck.path}: the draft's weights")
    model = Eagle3Draft(info, cfg)
    _load_state(model, state, ck)
    if model.embed_tokens is None and target is not None:
        model.attach_embeddings(target_embeddings(target))
    return model.eval()


def _load_state(model: Eagle3Draft, state: dict[str, torch.Tensor], ck: Checkpoint) -> None:
    own = model.state_dict()
    ignored = {"t2d", "verifier_norm.weight", "mask_hidden"}
    for name, t in state.items():
        if name in ignored or name.startswith("verifier_"):
            continue
        if name not in own:
            raise BadInput(f"{ck.path}: unexpected tensor {name!r} for an EAGLE-3 draft ({ck.layout} layout)")
        if tuple(own[name].shape) != tuple(t.shape):
            raise BadInput(f"{ck.path}: {name} is {list(t.shape)}, the config implies {list(own[name].shape)}")
    wanted = {k: v.to(own[k].dtype) for k, v in state.items() if k in own}
    if "d2t" not in wanted:
        wanted["d2t"] = own["d2t"]
    try:
        model.load_state_dict(wanted, strict=True)
    except RuntimeError as e:
        raise BadInput(f"{ck.path}: weights do not fit the config ({str(e).splitlines()[0][:160]})") from None


def target_embeddings(target: str | Path) -> torch.Tensor:
    """The token embedding matrix of an HF target folder (``model.embed_tokens.weight``), refused
    when it holds a value that is not finite."""
    from safetensors import safe_open

    from surgeon.verify.reference import resolve_model

    folder, _ = resolve_model(target)
    for f in sorted(folder.glob("*.safetensors")):
        weight = None
        try:
            with safe_open(str(f), framework="pt") as handle:
                key = next((k for k in ("model.embed_tokens.weight", "embed_tokens.weight") if k in handle.keys()), None)
                weight = None if key is None else handle.get_tensor(key).float()
        except Exception as e:  # SafetensorError and friends
            raise BadInput(f"{f}: not a readable safetensors file ({str(e).splitlines()[0][:120]})") from None
        if weight is not None:
            require_finite([("the token embeddings", weight)], str(f))
            return weight
    raise BadInput(f"{folder}: no model.embed_tokens.weight in its safetensors files")
