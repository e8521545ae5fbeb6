"""A synthetic hidden-state training set with seeded faults, for the audit's tests and benchmark.

The target is a tiny HF model folder the caller makes (``surgeon.run.tinymodels.make_tiny_model``:
the run layer sits above this one, so the folder is passed in). Each sample has its own tokens
(a BOS then random ids, a few lengths), runs through the target (batched by length, every point
recorded with module hooks) and is written in a real layout: SpecForge ``data_{i}.ckpt``,
speculators ``hs_{i}.safetensors`` or surgeon dumps ``dump_{i}.safetensors``, in ``dtype``.

Faults (each in ``count`` files, chosen by ``seed``; the map of file name -> fault is returned):

* ``shifted``: labels shifted by one slot: the aux slots hold ``embed`` and the first two aux
  points (what the Kimi-K2.5 set looked like);
* ``off_by_one``: every aux slot holds the layer after its declared one;
* ``nan``: NaN in a few rows of one slot;
* ``zero``: one slot all zeros;
* ``stale``: one slot is a copy of an earlier sample's (same length, other tokens).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from surgeon.core.points import EMBED, FINAL_NORM, Point, layer_out

FAULTS = ("shifted", "off_by_one", "nan", "zero", "stale")
LENGTHS = (64, 96, 128)
BOS = 0
AUX = (0, 2, 4)  # the spec's aux layers: early layers, where a tiny random target's norms tell layers apart
LAYOUTS = ("specforge", "speculators", "surgeon")
BATCH_TOKENS = 16384  # tokens per forward pass of the target


@dataclass
class SyntheticSet:
    root: Path
    spec: Path
    model: Path
    faults: dict[str, str] = field(default_factory=dict)  # file name -> fault
    files: int = 0


def spec_text(layout: str, num_layers: int, hidden: int) -> str:
    last = "final_norm" if layout != "speculators" else f"layer_out[{num_layers - 1}]"
    low, mid, high = (f"layer_out[{k}]" for k in AUX)
    return (f"spec: 1\nname: synthetic-{layout}\n"
            f"target: {{architecture: LlamaForCausalLM, num_layers: {num_layers}, hidden_size: {hidden}, model_type: llama}}\n"
            f"captures: {{low: '{low}', mid: '{mid}', high: '{high}', last: '{last}'}}\n"
            f"draft: {{kind: eagle3, fc_input: [low, mid, high], fc_in_features: {3 * hidden}}}\n"
            f"dumps: {{layout: {layout}, slots: [low, mid, high, last]}}\n")


def _run(model, batch):
    """{point: [B, T, H] float32} for a batch of equal-length token rows, through module hooks."""
    import torch

    inner = model.model
    out: dict[Point, torch.Tensor] = {}
    hooks = [inner.layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: out.__setitem__(EMBED, (args[0] if args else kwargs["hidden_states"]).detach()),
        with_kwargs=True)]
    for k, layer in enumerate(inner.layers):
        hooks.append(layer.register_forward_hook(
            lambda m, a, o, k=k: out.__setitem__(layer_out(k), (o[0] if isinstance(o, tuple) else o).detach())))
    hooks.append(inner.norm.register_forward_hook(lambda m, a, o: out.__setitem__(FINAL_NORM, o.detach())))
    try:
        with torch.no_grad():
            model(input_ids=batch)
    finally:
        for h in hooks:
            h.remove()
    return out


def _points(layout: str, fault: str | None, L: int) -> list[Point]:
    last = FINAL_NORM if layout != "speculators" else layer_out(L - 1)
    aux = [layer_out(k) for k in AUX]
    if fault == "shifted":
        aux = [EMBED, *aux[:2]]
    elif fault == "off_by_one":
        aux = [layer_out(k + 1) for k in AUX]
    return [*aux, last]


def _assign_faults(n: int, lengths: list[int], count: int, rng: random.Random,
                   kinds: tuple[str, ...] = FAULTS) -> tuple[dict[int, str], dict[int, int]]:
    """file index -> fault, and for each stale file the index of its (earlier, same-length) source."""
    faulty: dict[int, str] = {}
    sources: dict[int, int] = {}
    pool = list(range(n // 4, n))
    rng.shuffle(pool)
    for kind in kinds:
        for _ in range(count):
            while pool:
                i = pool.pop()
                if kind != "stale":
                    faulty[i] = kind
                    break
                src = next((j for j in range(i - 1, -1, -1) if lengths[j] == lengths[i] and j not in faulty
                            and j not in sources.values()), None)
                if src is not None:
                    faulty[i], sources[i] = kind, src
                    break
    return faulty, sources


def _write(layout: str, path: Path, ids, slots: list, points: list[Point], names: list[str], L: int) -> None:
    import torch

    if layout == "specforge":
        torch.save({"input_ids": ids[None], "loss_mask": torch.ones_like(ids)[None],
                    "aux_hidden_state": torch.cat(slots[:-1], dim=-1)[None], "hidden_state": slots[-1][None]}, path)
    elif layout == "speculators":
        from safetensors.torch import save_file

        save_file({"token_ids": ids, "hidden_states": torch.stack(slots, dim=1).contiguous()}, str(path))
    else:
        from surgeon.capture.dumps import write_dump

        write_dump(path, list(zip(names, points, slots)), input_ids=ids, num_layers=L, engine="synthetic")


def _load(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from surgeon.verify.reference import quiet_transformers

    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def make_synthetic_set(out_dir: str | Path, model_dir: str | Path, *, files: int = 1000, layout: str = "specforge",
                       count: int = 2, seed: int = 0, dtype: str = "bfloat16",
                       lengths: tuple[int, ...] = LENGTHS, kinds: tuple[str, ...] = FAULTS) -> SyntheticSet:
    """Write ``files`` samples of ``model_dir``'s hidden states under ``out_dir/set`` and their spec
    as ``out_dir/spec.yaml``; ``count`` files of each of ``kinds`` (of :data:`FAULTS`). Streamed: a
    batch of samples is written before the next is run (only the sources of stale copies are kept)."""
    import torch

    unknown = sorted(set(kinds) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}: one of {', '.join(FAULTS)}")

    out = Path(out_dir)
    root = out / "set"
    root.mkdir(parents=True, exist_ok=True)
    model = _load(Path(model_dir))
    L, H = model.config.num_hidden_layers, model.config.hidden_size
    spec = out / "spec.yaml"
    spec.write_text(spec_text(layout, L, H))
    rng = random.Random(seed)
    choices = lengths
    sizes = [rng.choice(choices) for _ in range(files)]
    faulty, sources = _assign_faults(files, sizes, count, rng, kinds)
    g = torch.Generator().manual_seed(seed)
    ids = [torch.cat([torch.tensor([BOS]), torch.randint(2, model.config.vocab_size, (t - 1,), generator=g)])
           for t in sizes]
    ext, stem = {"specforge": (".ckpt", "data"), "speculators": (".safetensors", "hs"),
                 "surgeon": (".safetensors", "dump")}[layout]
    width = len(str(files - 1))
    kept: dict[int, torch.Tensor] = {}
    sdt = getattr(torch, dtype)
    result = SyntheticSet(root, spec, Path(model_dir), {}, files)
    for t in sorted(set(choices)):
        idx = [i for i in range(files) if sizes[i] == t]
        rows = max(1, min(64, BATCH_TOKENS // t))  # every point of the batch is kept: bound its tokens
        for a in range(0, len(idx), rows):
            chunk = idx[a:a + rows]
            got = _run(model, torch.stack([ids[i] for i in chunk]))
            for b, i in enumerate(chunk):
                fault = faulty.get(i)
                pts = _points(layout, fault, L)
                slots = [got[p][b].to(sdt).contiguous() for p in pts]
                if i in sources.values():
                    kept[i] = slots[1].clone()
                if fault == "nan":
                    slots[1][5:8] = float("nan")
                elif fault == "zero":
                    slots[2].zero_()
                elif fault == "stale":
                    slots[1] = kept[sources[i]]
                name = f"{stem}_{i:0{width}d}{ext}"
                _write(layout, root / name, ids[i], slots, _points(layout, None, L), ["low", "mid", "high", "last"], L)
                if fault:
                    result.faults[name] = fault
    return result
