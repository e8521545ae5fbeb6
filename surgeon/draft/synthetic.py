"""A tiny target whose hidden states matter, and EAGLE-3 drafts trained on it with a KNOWN wiring.

Why: on tiny random targets fed uniform random tokens a trained one-layer draft rebuilds the next
token from its own embeddings and ignores the hidden states, so every wiring scores alike. Here
the target is trained on an induction language: each sequence is a run of
distinct random tokens repeated, so in the copy the next token is "the token that followed the
previous occurrence of the current token" -- a two-step circuit (previous-token head, then
induction head) that the target builds over its layers and that one draft layer fed the wrong
states cannot rebuild.

Measured (16 held-out prompts, 300 draft steps; ``surgeon.draft.behaviour``'s chained divergence,
what infer-wiring searches): with one fixed run length (``PERIOD``, the default) the trained wiring
comes first for drafts trained on [layer_out[1..3]], [embed, layer_out[1], layer_out[3]] and
[layer_out[0], layer_out[2], final_norm], 4-12% (2.5-5.7 paired standard errors) ahead of the
runner-up, while step-1 argmax agreement put every wiring within a point and the trained one 6th
to 10th; greedy acceptance drops by over 0.3 tokens (of 3) for the labels shifted by a slot. With
run lengths drawn from 5..12 (``min_period=5``, 1000 target steps, copy accuracy 0.97) the
divergence margins grow to 10-20%, but greedy acceptance no longer drops for the seed case's
shifted labels ([embed, layer_out[1], layer_out[2]]: 2.86 accepted, the trained wiring 2.86,
layer_out[2] in the last slot 2.95): a draft that copies by token identity finds it at every
layer, so that language is not the default.

The drafts are trained as SpecForge trains EAGLE-3 (``surgeon.draft.model`` docstring): the fc
reads the target's states at the wiring's points, the token embeddings are the target's (frozen),
the loss is the cross-entropy against the target's next-token distribution (soft labels, as
SpecForge's ``target_p``), over ``ttt`` chained steps (test-time training) with the draft's own
hidden output fed back. Everything is seeded; artifacts are cached under
``$XDG_CACHE_HOME/surgeon/draft-fixtures/<hash>`` keyed on every parameter and this module's and
``model.py``'s source, so a change of either retrains.

The cache cannot lie (issue 36), as the probe cache (:mod:`surgeon.engines.probes.cache`): a cache
directory that is a link, another user's, or writable by group or others is not used (the folder
is built in a private temporary directory instead, and that is said once); each folder carries a
manifest (:data:`MANIFEST`) of every file's SHA-256, sealed with the key and the per-user secret's
HMAC, and a folder is reused only when it holds exactly those files, regular and unlinked, with
those digests; otherwise it is set aside, rebuilt, and a note says why.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surgeon.core.errors import BadInput, InternalError
from surgeon.core.points import EMBED, FINAL_NORM, Point, layer_out, parse_point
from surgeon.core.safefile import UnsafeFile, describe_mode, read_bytes
from surgeon.draft.layouts import config_for, write_checkpoint
from surgeon.draft.model import DraftCache, DraftInfo, Eagle3Draft, RMSNorm, SwiGLU, one_thread, rotate_half
from surgeon.engines.probes import cache as _cache

VOCAB = 64
SEQ = 36
PERIOD = 12
#: None: every run is PERIOD long (the default, see the module docstring); an int: each run's length
#: is drawn from MIN_PERIOD..PERIOD
MIN_PERIOD: int | None = None
HEADS = 4


MANIFEST = "manifest.json"
FIXTURE_LIMIT = 256 << 20  # the largest file of a fixture folder (the tiny targets' weights: under 1 MiB)
_WHAT = "the draft-fixtures cache"


def cache_root() -> Path:
    return _cache.directory() / "draft-fixtures"


def _key(kind: str, params: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for mod in (Path(__file__), Path(__file__).with_name("model.py"), Path(__file__).with_name("layouts.py")):
        h.update(mod.read_bytes())
    h.update(json.dumps({"kind": kind, **params}, sort_keys=True, default=str).encode())
    return f"{kind}-{h.hexdigest()[:16]}"


def _cached(kind: str, params: dict[str, Any], build) -> Path:
    """``build(tmp_dir)`` once per key; the folder appears atomically (a rename), sealed by its
    manifest, and is reused only while the manifest vouches for every file in it."""
    name, root = _key(kind, params), cache_root()
    secret = None
    if _cache.make_private(root.parent, _WHAT) and _cache.make_private(root, _WHAT):
        secret = _cache.secret(create=True, what=_WHAT)
    if secret is None:
        return _private_build(name, params, build)
    out = root / name
    why = _unsound(out, name, secret)
    if why is None:
        return out
    if why != "absent":
        _cache.note(f"{out}: {why}; set aside and built again")
        _discard(out)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=root))
    try:
        _fill(tmp, name, params, build, secret)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: theirs if sound, else ours, uncached
            if _unsound(out, name, secret) is None:
                return out
            return _keep_until_exit(tmp)
    finally:
        if tmp.exists() and tmp not in _KEPT:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _fill(folder: Path, name: str, params: dict[str, Any], build, secret: bytes | None) -> None:
    build(folder)
    (folder / "params.json").write_text(json.dumps(params, sort_keys=True, default=str, indent=1) + "\n")
    if secret is not None:
        files = {rel: hashlib.sha256((folder / rel).read_bytes()).hexdigest() for rel in _listing(folder)[0]}
        payload = json.dumps({"files": files}, sort_keys=True).encode()
        (folder / MANIFEST).write_bytes(_cache.seal(secret, name, payload))


_KEPT: list[Path] = []


def _keep_until_exit(folder: Path) -> Path:
    """``folder`` outside the cache, removed when this process exits."""
    _KEPT.append(folder)
    if len(_KEPT) == 1:
        atexit.register(_remove_kept)
    return folder


def _remove_kept() -> None:
    for folder in _KEPT:
        shutil.rmtree(folder, ignore_errors=True)


def _private_build(name: str, params: dict[str, Any], build) -> Path:
    """No trustworthy cache: build in a private temporary directory (mode 0700), for this process."""
    folder = Path(tempfile.mkdtemp(prefix=f"surgeon-{name}."))
    _keep_until_exit(folder)
    _fill(folder, name, params, build, None)
    return folder


def _listing(folder: Path) -> tuple[list[str], list[str]]:
    """(regular files, anything else) under ``folder``, relative, the manifest left out; links
    are never followed (a link, FIFO or device is "anything else")."""
    files, odd = [], []
    for top, dirs, names in os.walk(folder):
        for n in [*dirs, *names]:
            rel = os.path.relpath(os.path.join(top, n), folder)
            mode = os.lstat(os.path.join(top, n)).st_mode
            if stat.S_ISREG(mode):
                files.append(rel)
            elif not stat.S_ISDIR(mode):
                odd.append(rel)
    return sorted(f for f in files if f != MANIFEST), sorted(odd)


def _unsound(out: Path, name: str, secret: bytes) -> str | None:
    """Why cached folder ``out`` must not be used ("absent": not there), None when its sealed
    manifest vouches for exactly the regular files it holds."""
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return "absent"
    except OSError as e:
        return f"cannot be inspected ({e.strerror or e})"
    if not stat.S_ISDIR(mode):
        return f"is {describe_mode(mode)}, not a folder"
    return _manifest_problem(out, name, secret)


def _manifest_problem(out: Path, name: str, secret: bytes) -> str | None:
    """Why folder ``out``'s manifest does not vouch for what it holds (None: it does)."""
    try:
        raw = read_bytes(out / MANIFEST, limit=1 << 20, follow=False, what="the fixture manifest")
        files = json.loads(_cache.unseal(secret, name, raw))["files"]
        listed, odd = _listing(out)
        if odd or sorted(files) != listed:
            return f"holds other files than its manifest lists ({', '.join(odd or sorted(set(listed) ^ set(files)))})"
        for rel, digest in files.items():
            data = read_bytes(out / rel, limit=FIXTURE_LIMIT, follow=False, what="the fixture file")
            if hashlib.sha256(data).hexdigest() != digest:
                return f"{rel} does not match its digest (edited or damaged)"
    except FileNotFoundError:
        return "a file is missing (no manifest: an older surgeon's, or damaged)"
    except (UnsafeFile, _cache.Mismatch, OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def _discard(out: Path) -> None:
    """Set ``out`` aside (a rename: a link is moved, never followed) and remove it."""
    aside = out.with_name(f".{out.name}.discard-{secrets.token_hex(4)}")
    try:
        os.rename(out, aside)
        if stat.S_ISDIR(os.lstat(aside).st_mode):
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.unlink(aside)
    except OSError:
        pass


# -- the language ---------------------------------------------------------------------------


def induction_batch(n: int, *, seq: int = SEQ, period: int = PERIOD, vocab: int = VOCAB,
                    generator: torch.Generator, min_period: int | None = MIN_PERIOD) -> torch.Tensor:
    """``n`` sequences [n, seq]: a run of distinct random tokens, repeated to fill ``seq``; each
    run's length is drawn from ``min_period..period`` (``None``: always ``period``)."""
    if period > vocab:
        raise BadInput(f"period {period} needs {period} distinct tokens, vocab is {vocab}")
    low = period if min_period is None else min_period
    rows = []
    for _ in range(n):
        k = int(torch.randint(low, period + 1, (1,), generator=generator)) if low < period else period
        run = torch.randperm(vocab, generator=generator)[:k]
        rows.append(run.repeat(-(-seq // k))[:seq])
    return torch.stack(rows)


# -- the target -----------------------------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        d = self.head_dim
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        freqs = torch.arange(T, dtype=torch.float32)[:, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos(), emb.sin()

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, T, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class _Layer(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.self_attn = _Attention(hidden, HEADS)
        self.mlp = SwiGLU(hidden, 2 * hidden)
        self.input_layernorm = RMSNorm(hidden, 1e-6)
        self.post_attention_layernorm = RMSNorm(hidden, 1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Base(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([_Layer(hidden) for _ in range(layers)])
        self.norm = RMSNorm(hidden, 1e-6)


class LeanLlama(nn.Module):
    """transformers' Llama forward (RMSNorm, RoPE, causal attention, SwiGLU) in plain torch, with
    ``LlamaForCausalLM``'s parameter names: it trains several times faster on a busy CPU, and
    :func:`_to_transformers` checks that transformers computes the same logits from its weights."""

    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.model = _Base(vocab, hidden, layers)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def states(self, ids: torch.Tensor) -> tuple[dict[Point, torch.Tensor], torch.Tensor]:
        """Every point's state [B, T, H] and the logits [B, T, V]."""
        x = self.model.embed_tokens(ids)
        out = {EMBED: x}
        for k, layer in enumerate(self.model.layers):
            x = layer(x)
            out[layer_out(k)] = x
        out[FINAL_NORM] = self.model.norm(x)
        return out, self.lm_head(out[FINAL_NORM])


def _target_config(num_layers: int, hidden_size: int, vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                       num_hidden_layers=num_layers, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                       head_dim=hidden_size // HEADS, max_position_embeddings=256, tie_word_embeddings=False,
                       bos_token_id=0, eos_token_id=1, pad_token_id=None, rms_norm_eps=1e-6, rope_theta=10000.0)


def synthetic_target(*, num_layers: int = 4, hidden_size: int = 64, vocab: int = VOCAB, seq: int = SEQ,
                     period: int = PERIOD, min_period: int | None = MIN_PERIOD, steps: int = 300, seed: int = 0) -> Path:
    """A tiny Llama trained on the induction language (a ``save_pretrained`` folder, cached);
    ``copy_accuracy.json`` there holds its greedy accuracy on the repeated part."""
    params: dict[str, Any] = dict(num_layers=num_layers, hidden_size=hidden_size, vocab=vocab, seq=seq, period=period,
                  min_period=min_period, steps=steps, seed=seed)
    return _cached("target", params, lambda out: _train_target(out, **params))


def _fit(model: nn.Module, steps: int, loss_of: Callable[[], torch.Tensor]) -> None:
    """AdamW with a one-cycle schedule, on one thread (tiny matrices: a second thread only adds
    contention on a shared 2-core machine, measured ~10x slower here)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    with one_thread():
        for _ in range(steps):
            loss = loss_of()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()


def _train_target(out: Path, *, num_layers: int, hidden_size: int, vocab: int, seq: int, period: int,
                  min_period: int | None, steps: int, seed: int) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        lean = LeanLlama(vocab, hidden_size, num_layers)

        def loss() -> torch.Tensor:
            batch = induction_batch(16, seq=seq, period=period, vocab=vocab, generator=g, min_period=min_period)
            _, logits = lean.states(batch)
            return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), batch[:, 1:].reshape(-1))

        _fit(lean, steps, loss)
        lean.eval()
        _to_transformers(lean, num_layers, hidden_size, vocab, seq, period).save_pretrained(out, safe_serialization=True)
        accuracy = copy_accuracy(lean, seq, period, vocab, min_period)
        (out / "copy_accuracy.json").write_text(json.dumps({"copy_accuracy": accuracy}) + "\n")


def _to_transformers(lean: LeanLlama, num_layers: int, hidden_size: int, vocab: int, seq: int, period: int):
    """The same weights in a transformers ``LlamaForCausalLM``; its logits must equal ours."""
    from transformers import LlamaForCausalLM

    from surgeon.verify.reference import quiet_transformers

    with quiet_transformers():
        hf = LlamaForCausalLM(_target_config(num_layers, hidden_size, vocab)).eval()
    hf.load_state_dict(lean.state_dict(), strict=True)
    ids = induction_batch(4, seq=seq, period=period, vocab=vocab, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        ours = lean.states(ids)[1]
        theirs = hf(input_ids=ids, use_cache=False).logits
    gap = float((ours - theirs).abs().max())
    if gap > 1e-3:
        raise InternalError(f"the synthetic target's torch forward differs from transformers' Llama by {gap:.2e}")
    return hf


@torch.no_grad()
def copy_accuracy(model: LeanLlama, seq: int = SEQ, period: int = PERIOD, vocab: int = VOCAB,
                  min_period: int | None = MIN_PERIOD) -> float:
    """The target's greedy accuracy where the next token is a copy (after each sequence's first run)."""
    batch = induction_batch(64, seq=seq, period=period, vocab=vocab, generator=torch.Generator().manual_seed(12345),
                            min_period=min_period)
    pred = model.states(batch)[1].argmax(-1)[:, :-1]
    nxt = batch[:, 1:]
    copied = torch.stack([torch.arange(seq - 1) + 1 >= first_repeat(row) for row in batch])
    return float((pred == nxt)[copied].float().mean())


def first_repeat(row: torch.Tensor) -> int:
    """The position of the first token that repeats an earlier one (the run's length)."""
    seen: set[int] = set()
    for i, x in enumerate(row.tolist()):
        if x in seen:
            return i
        seen.add(x)
    return len(row)


def load_lean(target_dir: Path) -> LeanLlama:
    """A synthetic target folder back into :class:`LeanLlama` (its weights, strictly)."""
    from safetensors.torch import load_file

    cfg = json.loads((target_dir / "config.json").read_text())
    lean = LeanLlama(int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]))
    lean.load_state_dict(load_file(str(target_dir / "model.safetensors")), strict=True)
    return lean.eval()


# -- drafts ---------------------------------------------------------------------------------


def spec_ids(wiring: Sequence[Point]) -> list[int] | None:
    """SpecForge's ids for a wiring (id k = layer_out[k]); None when a point has no such id."""
    if all(p.kind == "layer_out" for p in wiring):
        return [p.index for p in wiring if p.index is not None]
    return None


def train_draft(target_dir: str | Path, wiring: Sequence[Point | str], *, seed: int = 0, steps: int = 300,
                ttt: int = 3, layout: str = "specforge", stated: list[int] | None | str = "auto") -> Path:
    """An EAGLE-3 draft (a draft folder in ``layout``) trained on ``target_dir``'s states at
    ``wiring`` (one point per fc slot, in slot order). ``stated``: the ids its config states
    ("auto": SpecForge's ids of the wiring when every point is a layer output; None: no ids)."""
    target_dir = Path(target_dir)
    cfg = json.loads((target_dir / "config.json").read_text())
    L = int(cfg["num_hidden_layers"])
    points = [parse_point(p, L) if isinstance(p, str) else p for p in wiring]
    ids = spec_ids(points) if isinstance(stated, str) else stated
    params = dict(target=_target_fingerprint(target_dir), wiring=[str(p) for p in points], seed=seed, steps=steps,
                  ttt=ttt, layout=layout, stated=ids)
    return _cached("draft", params, lambda out: _train_draft(out, target_dir, points, seed, steps, ttt, layout, ids))


def _target_fingerprint(target_dir: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        f = target_dir / name
        if not f.is_file():
            raise BadInput(f"{target_dir}: no {name} (expected a synthetic_target folder)")
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def new_draft(target: LeanLlama, n_slots: int) -> tuple[Eagle3Draft, dict[str, Any]]:
    """A fresh draft shaped for ``target`` (its hidden size and vocabulary), embeddings and LM head
    initialised from the target's (SpecForge loads the target's embeddings and freezes them)."""
    H, V = target.lm_head.in_features, target.lm_head.out_features
    layer = dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=2 * H,
                 vocab_size=V, draft_vocab_size=V, rms_norm_eps=1e-6, rope_theta=10000.0)
    info = DraftInfo(path="<training>", layout="specforge", kind="eagle3", hidden_size=H, n_slots=n_slots,
                     target_vocab_size=V, draft_vocab_size=V, stated_ids={})
    draft = Eagle3Draft(info, {**layer, "head_dim": H // HEADS, "target_hidden_size": H})
    assert draft.embed_tokens is not None
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
    draft.embed_tokens.weight.requires_grad_(False)
    return draft, layer


def chain_loss(draft: Eagle3Draft, slots: list[torch.Tensor], ids: torch.Tensor, logits: torch.Tensor,
               ttt: int) -> torch.Tensor:
    """SpecForge's TTT loss over a batch: step j pairs position t with token t+1+j and the
    target's distribution at t+1+j (``surgeon.draft.model`` docstring), steps weighted 0.8^j."""
    T = ids.shape[1]
    h = draft.fuse(slots)
    cache = DraftCache()
    total = h.new_zeros(())
    for j in range(ttt):
        n = T - 1 - j
        step_ids = torch.zeros_like(ids)
        step_ids[:, :n] = ids[:, 1 + j:]
        out, h = draft.step(h, step_ids, cache)
        target_p = torch.softmax(logits[:, 1 + j:], -1)
        total = total - (target_p * torch.log_softmax(out[:, :n], -1)).sum(-1).mean() * (0.8 ** j)
    return total


def _train_draft(out: Path, target_dir: Path, points: list[Point], seed: int, steps: int, ttt: int,
                 layout: str, ids: list[int] | None) -> None:
    params = json.loads((target_dir / "params.json").read_text())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed + 1)
        target = load_lean(target_dir)
        vocab = target.lm_head.out_features
        pool = induction_batch(256, seq=params["seq"], period=params["period"], vocab=vocab, generator=g,
                               min_period=params.get("min_period"))
        with torch.no_grad():
            states, logits = target.states(pool)  # the target's states, once
        draft, layer = new_draft(target, len(points))

        def loss() -> torch.Tensor:
            pick = torch.randint(0, pool.shape[0], (16,), generator=g)
            return chain_loss(draft, [states[p][pick] for p in points], pool[pick], logits[pick], ttt)

        _fit(draft, steps, loss)
        config = config_for(layout, hidden_size=layer["hidden_size"], num_attention_heads=HEADS,
                            num_key_value_heads=HEADS, intermediate_size=layer["intermediate_size"], vocab_size=vocab,
                            draft_vocab_size=vocab, ids=ids)
        state = {k: v for k, v in draft.state_dict().items() if k != "d2t"}
        write_checkpoint(out, layout, config, state)
        (out / "trained_on.json").write_text(json.dumps({"wiring": [str(p) for p in points]}) + "\n")
