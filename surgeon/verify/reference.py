"""Reference hidden states: every capture point of a real forward pass, recorded by hooks.

:func:`capture_reference` loads a local transformers model, runs one forward pass on a batch
of one and records, with module hooks (never trusting ``output_hidden_states`` alone):

* ``embed``: the hidden states entering decoder layer 0 (a forward pre-hook);
* ``layer_out[k]``: decoder layer ``k``'s output, residual included;
* ``final_norm``: the final norm's output (the LM head's input);
* ``layer_delta[k]``: layer ``k``'s output *without* the residual, i.e. the output of its last
  residual branch (the MLP / MoE block, or its post-feedforward norm where the layer has one).
  That is what an engine carrying the residual separately holds in ``hidden_states`` after
  layer ``k``: what a capture that forgot the residual records (sgl-project/sglang#39286).

A :class:`Reference` saves to one safetensors file: one tensor per ``str(point)`` plus
``input_ids``, with metadata ``surgeon.kind = reference``, ``num_layers``, ``hidden_size`` and
``source``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from surgeon.capture.tensorfiles import read_safetensors
from surgeon.core.errors import BadInput
from surgeon.core.points import EMBED, FINAL_NORM, Point, all_points, layer_out, parse_point
from surgeon.core.safefile import UnsafeFile, describe_mode, read_text, write_file

KIND = "reference"
_META_KEYS = ("surgeon.kind", "num_layers", "hidden_size", "source")
# Where the last residual branch of a decoder layer lives, most specific first: a
# post-feedforward norm (Gemma 2/3, OLMo 2) sits between the MLP and the residual add.
_BRANCH_NAMES = ("post_feedforward_layernorm", "mlp", "block_sparse_moe", "feed_forward")
_NORM_NAMES = ("norm", "final_layernorm", "final_norm")


@dataclass
class Reference:
    states: dict[Point, torch.Tensor]  # each [T, H] float32 CPU
    input_ids: torch.Tensor  # [T] int64
    num_layers: int
    hidden_size: int
    source: str

    def __getitem__(self, point: Point | str) -> torch.Tensor:
        if isinstance(point, str):
            point = parse_point(point, self.num_layers, allow_delta=True)
        return self.states[point]


class NotFinite(BadInput):
    """Weights, states or a result holding NaN or infinite values: nothing measured from them is a
    number worth printing (an acceptance rate, a divergence, an alignment), so the input is refused."""


def require_finite(tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """NotFinite naming the first floating tensor of ``tensors`` (name, tensor) with a NaN or an
    infinite value, and how many it holds."""
    for name, t in tensors:
        if not (t.is_floating_point() or t.is_complex()):
            continue
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise NotFinite(f"{where}: {name} has {bad} of {t.numel()} values that are not finite (NaN or "
                            "infinite); nothing measured from it would be a number")


def sweep_points(num_layers: int) -> list[Point]:
    """Every capturable point of an ``L``-layer model, forward order, deltas included:
    ``embed, layer_delta[0], layer_out[0], ..., layer_delta[L-1], layer_out[L-1], final_norm``."""
    return all_points(num_layers, with_deltas=True)


# -- capture ------------------------------------------------------------------------------


def _as_input_ids(input_ids: Any) -> torch.Tensor:
    if isinstance(input_ids, torch.Tensor):
        t = input_ids.detach().cpu()
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 1:
            raise BadInput(f"input_ids must be 1-D (or [1, T]), got shape {list(input_ids.shape)}")
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise BadInput(f"input_ids must be integers, got dtype {t.dtype}")
        ids = t.to(torch.int64)
    else:
        if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Iterable):
            raise BadInput(f"input_ids must be a list of token ids, not {type(input_ids).__name__}")
        values = list(input_ids)
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int):
                raise BadInput(f"input_ids[{i}] is {v!r}: token ids are integers")
        ids = torch.tensor(values, dtype=torch.int64)
    if ids.numel() == 0:
        raise BadInput("input_ids is empty: give at least one token id")
    return ids.contiguous()


def _find_structure(model) -> tuple[Any, list[torch.nn.Module], torch.nn.Module]:
    """``(base, decoder layers, final norm)`` of a causal LM, or BadInput."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None) if base is not None else None
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise BadInput(
            f"unrecognised model structure ({type(model).__name__}): expected decoder layers "
            "at model.model.layers"
        )
    norm = next((getattr(base, n) for n in _NORM_NAMES if isinstance(getattr(base, n, None), torch.nn.Module)), None)
    if norm is None:
        raise BadInput(
            f"unrecognised model structure ({type(model).__name__}): no final norm at "
            f"model.model.{{{','.join(_NORM_NAMES)}}}"
        )
    return base, list(layers), norm


def _branch_module(layer: torch.nn.Module, k: int) -> torch.nn.Module:
    for name in _BRANCH_NAMES:
        module = getattr(layer, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise BadInput(
        f"unrecognised decoder layer {k} ({type(layer).__name__}): no MLP branch at "
        f"layer.{{{','.join(_BRANCH_NAMES)}}}"
    )


def _first_tensor(value: Any) -> torch.Tensor:
    while isinstance(value, (tuple, list)):
        value = value[0]
    if hasattr(value, "last_hidden_state"):  # a ModelOutput
        value = value.last_hidden_state
    if not isinstance(value, torch.Tensor):
        raise BadInput(f"a hooked module returned {type(value).__name__}, not a tensor")
    return value


def _to_state(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    return t.to(device="cpu", dtype=torch.float32).clone()


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' progress bars and info logs for the duration."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    level = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def resolve_model(model: str | Path) -> tuple[Path, str]:
    """(local folder, label) of a model argument: an HF model folder, else ``ORG/NAME`` looked up
    in the local Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``; never downloaded, so it
    works offline). A model that is in neither is BadInput saying how to fetch it."""
    path = Path(model)
    if path.is_dir():
        check_model_folder(path)
        return path, f"hf:{path.resolve()}"
    text = str(model)
    if path.exists() or not _REPO_ID.fullmatch(text) or text.endswith((".json", ".safetensors")):
        raise BadInput(f"{model}: not a model directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(text, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise BadInput(f"{model}: no such directory, and not in the local Hugging Face cache ({HF_HUB_CACHE}); fetch it "
                       f"with `hf download {text}` (or `huggingface-cli download {text}`), then run this again") from None
    except (HFValidationError, ValueError) as e:
        raise BadInput(f"{model}: not a model directory nor a Hugging Face repo id ({str(e).splitlines()[0][:120]})") from None
    check_model_folder(folder)
    return folder, f"hf:{text}@{folder.name}"


#: a model folder's config.json is read whole: at most this many bytes
MAX_CONFIG_BYTES = 16 << 20


def check_model_folder(folder: Path) -> None:
    """Refuse a model folder holding anything transformers could open that is neither a regular
    file nor a folder (links followed, as the Hugging Face cache's are): a FIFO named config.json
    or *.safetensors would hang the load, a device would be read without end."""
    try:
        entries = list(os.scandir(folder))
    except OSError as e:
        raise UnsafeFile(f"{folder}: cannot list the model folder ({e.strerror or e})") from None
    for entry in entries:
        try:
            mode = os.stat(entry.path).st_mode  # never opens it: a FIFO does not block here
        except FileNotFoundError:  # a dangling link: transformers names it if it needs it
            continue
        except OSError as e:
            raise UnsafeFile(f"{entry.path}: cannot inspect it ({e.strerror or e})") from None
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UnsafeFile(f"{entry.path}: is {describe_mode(mode)}, not a regular file; the model folder "
                             "is not loaded")


def read_model_config(model_dir: Path) -> dict:
    """A model folder's config.json as a JSON object (regular, bounded, UTF-8), else BadInput."""
    cfg = model_dir / "config.json"
    try:
        data = json.loads(read_text(cfg, limit=MAX_CONFIG_BYTES, what="the model's config.json"))
    except FileNotFoundError:
        raise BadInput(f"{model_dir}: no config.json (expected a transformers save_pretrained folder)") from None
    except (json.JSONDecodeError, RecursionError) as e:
        at = f"{cfg}:{e.lineno}:{e.colno}" if isinstance(e, json.JSONDecodeError) else str(cfg)
        raise BadInput(f"{at}: invalid JSON: {getattr(e, 'msg', 'nested too deeply')}") from None
    if isinstance(data, dict):
        return data
    raise BadInput(f"{cfg}:1:1: a model config is a JSON object, not {type(data).__name__}")


def load_model(model_dir: Path, dtype: torch.dtype, device: str = "cpu"):
    """The causal LM of a model folder (checked: no FIFO or device in it, a readable config.json),
    on ``device``; whatever transformers or safetensors cannot load (a damaged header, weights
    that do not fit the config) is BadInput naming the folder, one line."""
    from transformers import AutoModelForCausalLM

    if not model_dir.is_dir():
        raise BadInput(f"{model_dir}: not a model directory")
    check_model_folder(model_dir)
    read_model_config(model_dir)
    try:
        with quiet_transformers():
            model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=dtype,
                                                               output_loading_info=True)
    except MemoryError:
        raise
    except Exception as e:  # OSError, ValueError, SafetensorError, a RuntimeError of mismatched shapes, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise BadInput(f"{model_dir}: cannot load as a causal LM: {first}") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers initialises them at random: a reference of such a model records noise
        raise BadInput(f"{model_dir}: the weights lack {len(missing)} tensor(s) the config needs (e.g. {missing[0]}): "
                       "config and weights disagree (a config without num_hidden_layers takes transformers' default)")
    try:
        dev = torch.device(device)
        if dev.type == "meta":
            raise ValueError("the meta device holds no values to record")
        return model.to(dev)
    except (RuntimeError, AssertionError, ValueError) as e:  # a device torch does not know or cannot reach
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise BadInput(f"--device {device}: not usable here ({first})") from None


def capture_reference(model_dir: str | Path, input_ids: Any, *, dtype: torch.dtype = torch.float32,
                      device: str = "cpu") -> Reference:
    """Run one forward pass of the local model at ``model_dir`` (a folder, or ``ORG/NAME`` in the
    local Hugging Face cache) on ``input_ids`` (a batch of one), in ``dtype`` on ``device``, and
    record every point of :func:`sweep_points` with hooks (stored as float32 on the CPU)."""
    ids = _as_input_ids(input_ids)
    model_dir, source = resolve_model(model_dir)
    model = load_model(model_dir, dtype, device)
    model.eval()
    layers, norm = checked_structure(model, model_dir, ids)
    L = len(layers)
    recorder = ForwardRecorder(L)
    recorder.record(model, layers, norm, ids)
    recorder.check_plain_residual_stack(model_dir)
    states = recorder.states()
    require_finite(((f"state {p}", t) for p, t in states.items()), f"{model_dir} (run on these ids)")
    T, H = states[EMBED].shape
    for point, t in states.items():
        if tuple(t.shape) != (T, H):
            raise BadInput(f"{model_dir}: {point} has shape {list(t.shape)}, expected {[T, H]}")
    return Reference(
        states={p: states[p] for p in sweep_points(L)},
        input_ids=ids,
        num_layers=L,
        hidden_size=H,
        source=source,
    )


class OutOfVocabulary(BadInput):
    """Token ids the model has no embedding for: the ids' fault, not the model's."""


def checked_structure(model, model_dir: Path, ids: torch.Tensor) -> tuple[list[torch.nn.Module], torch.nn.Module]:
    """The decoder layers and final norm, refused when the config disagrees with them or the ids
    fall outside the vocabulary."""
    _, layers, norm = _find_structure(model)
    L = len(layers)
    declared = getattr(model.config, "num_hidden_layers", L)
    if declared != L:
        raise BadInput(f"{model_dir}: config says {declared} layers but the model has {L}")
    vocab = model.get_input_embeddings().num_embeddings
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.numel():
        raise OutOfVocabulary(f"token id {int(bad[0])} is out of the vocabulary (0..{vocab - 1})")
    return layers, norm


class ForwardRecorder:
    """Hooks on every decoder layer (input, output, MLP branch) and the final norm for one forward
    pass, and the checks that the model is the plain residual stack the points assume."""

    def __init__(self, num_layers: int) -> None:
        L = self.num_layers = num_layers
        self.inputs: dict[int, list[torch.Tensor]] = {k: [] for k in range(L)}
        self.outputs: dict[int, list[torch.Tensor]] = {k: [] for k in range(L)}
        self.deltas: dict[int, list[torch.Tensor]] = {k: [] for k in range(L)}
        self.normed: list[torch.Tensor] = []

    def _pre_hook(self, k: int):
        def hook(module, args, kwargs):
            hs = args[0] if args else kwargs.get("hidden_states")
            if hs is None:
                raise BadInput(f"decoder layer {k} was called without hidden_states")
            self.inputs[k].append(_to_state(_first_tensor(hs)))

        return hook

    @staticmethod
    def _out_hook(store, k=None):
        def hook(module, args, output):
            (store if k is None else store[k]).append(_to_state(_first_tensor(output)))

        return hook

    def record(self, model, layers: list[torch.nn.Module], norm: torch.nn.Module, ids: torch.Tensor) -> None:
        """One forward pass with the hooks on; they are removed whatever happens."""
        handles = []
        try:
            for k, layer in enumerate(layers):
                handles.append(layer.register_forward_pre_hook(self._pre_hook(k), with_kwargs=True))
                handles.append(layer.register_forward_hook(self._out_hook(self.outputs, k)))
                handles.append(_branch_module(layer, k).register_forward_hook(self._out_hook(self.deltas, k)))
            handles.append(norm.register_forward_hook(self._out_hook(self.normed)))
            with torch.no_grad():
                model(input_ids=ids[None].to(model.device), use_cache=False)
        finally:
            for h in handles:
                h.remove()

    def check_plain_residual_stack(self, model_dir: Path) -> None:
        """Each hook fired once, and each layer's input is the previous layer's output."""
        L = self.num_layers
        for name, store in (("input", self.inputs), ("output", self.outputs), ("MLP branch", self.deltas)):
            for k in range(L):
                if len(store[k]) != 1:
                    raise BadInput(
                        f"{model_dir}: the {name} hook of decoder layer {k} fired {len(store[k])} "
                        "times in one forward pass (unrecognised model structure)"
                    )
        if len(self.normed) != 1:
            raise BadInput(f"{model_dir}: the final norm ran {len(self.normed)} times in one forward pass")
        for k in range(L - 1):
            if not torch.equal(self.outputs[k][0], self.inputs[k + 1][0]):
                raise BadInput(
                    f"{model_dir}: decoder layer {k + 1}'s input is not layer {k}'s output: not a "
                    "plain residual stack (unrecognised model structure)"
                )

    def states(self) -> dict[Point, torch.Tensor]:
        states: dict[Point, torch.Tensor] = {EMBED: self.inputs[0][0]}
        for k in range(self.num_layers):
            states[Point("layer_delta", k)] = self.deltas[k][0]
            states[layer_out(k)] = self.outputs[k][0]
        states[FINAL_NORM] = self.normed[0]
        return states


# -- measures -----------------------------------------------------------------------------


def adjacent_layer_gap(ref: Reference) -> float:
    """Median over ``k = 1..L-1`` of ``|layer_out[k] - layer_out[k-1]| / |layer_out[k-1]|``
    (Frobenius norms over all tokens). Real deep models sit at a few percent; a model with
    fewer than two layers has no adjacent pair and gives ``nan``."""
    gaps = []
    for k in range(1, ref.num_layers):
        prev, cur = ref.states[layer_out(k - 1)], ref.states[layer_out(k)]
        gaps.append(float((cur - prev).norm() / prev.norm().clamp_min(1e-30)))
    return statistics.median(gaps) if gaps else float("nan")


# -- files --------------------------------------------------------------------------------


def save_reference(ref: Reference, path: str | Path, *, overwrite: bool = False) -> None:
    """Write ``ref`` to one new safetensors file (atomically, never through a link; an existing file
    is replaced only with ``overwrite``)."""
    from safetensors.torch import save

    tensors = {str(p): t.detach().to("cpu", torch.float32).contiguous() for p, t in ref.states.items()}
    tensors["input_ids"] = ref.input_ids.detach().to("cpu", torch.int64).contiguous()
    metadata = {
        "surgeon.kind": KIND,
        "num_layers": str(int(ref.num_layers)),
        "hidden_size": str(int(ref.hidden_size)),
        "source": str(ref.source),
    }
    write_file(path, save(tensors, metadata=metadata), overwrite=overwrite, what="the reference file")


def load_reference(path: str | Path) -> Reference:
    """Read a file written by :func:`save_reference`; anything malformed raises BadInput."""
    path = Path(path)
    tensors, metadata = read_safetensors(path)

    def bad(why: str) -> BadInput:
        return BadInput(f"{path}: not a surgeon reference: {why}")

    if metadata.get("surgeon.kind") != KIND:
        raise bad(f"metadata surgeon.kind is {metadata.get('surgeon.kind')!r}, expected {KIND!r}")
    for key in _META_KEYS:
        if key not in metadata:
            raise bad(f"metadata has no {key!r}")
    try:
        L, H = int(metadata["num_layers"]), int(metadata["hidden_size"])
    except ValueError:
        raise bad("metadata num_layers/hidden_size are not integers") from None
    if L < 1 or H < 1:
        raise bad(f"num_layers {L} and hidden_size {H} must be positive")

    ids = tensors.pop("input_ids", None)
    if ids is None:
        raise bad("no 'input_ids' tensor")
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() == 0:
        raise bad(f"'input_ids' must be a non-empty 1-D int64 tensor, got {ids.dtype} {list(ids.shape)}")
    T = ids.numel()

    expected = {str(p): p for p in sweep_points(L)}
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise bad(f"missing tensor {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise bad(f"unexpected tensor {extra[0]!r}")
    states: dict[Point, torch.Tensor] = {}
    for name, point in expected.items():
        t = tensors[name]
        if t.dtype != torch.float32 or tuple(t.shape) != (T, H):
            raise bad(f"{name} is {t.dtype} {list(t.shape)}, expected float32 {[T, H]}")
        states[point] = t
    require_finite(((name, tensors[name]) for name in expected), f"{path}: not a usable reference")
    return Reference(states=states, input_ids=ids, num_layers=L, hidden_size=H, source=metadata["source"])
