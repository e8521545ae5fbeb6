"""How the DFlash trainers name target layers: SpecForge, speculators and z-lab/dflash, a cited
table (each fact: repository, commit, file, line, and the text on that line).

Read from GitHub snapshots of the three repositories (``git show <commit>:<path>``, line numbers
from ``git grep -n``), not from an installed package: :func:`surgeon.engines.facts.field_tables.check_against_source`
compares a checkout with the table (``python -m surgeon.engines.facts.field_tables specforge|speculators|zlab DIR``).

- SpecForge: the draft config's ``dflash_config.target_layer_ids``, handed to SGLang's
  ``set_dflash_layers_to_capture`` by its capture backend: SGLang's own DFlash convention (the
  probed one, :func:`surgeon.wiring.render.sglang_dflash`).
- speculators: ``aux_hidden_state_layer_ids`` in the draft config (``--target-layer-ids`` when
  training), the ids its data generation hands to vLLM's ``eagle_aux_hidden_state_layer_ids``:
  vLLM's aux convention (the probed one); its z-lab converter adds 1 to z-lab's ids.
- z-lab/dflash: ``dflash_config.target_layer_ids`` read as ``output_hidden_states[id + 1]``
  (HF transformers): id k = layer_out[k], -1 the embedding, L-1 the final norm's output.
"""

from __future__ import annotations

from surgeon.core.conventions import HF, InvalidId, NotExpressible, PointwiseConvention
from surgeon.core.points import Point
from surgeon.engines.facts.field_tables import Cite

SPECFORGE_REPO, SPECFORGE_COMMIT = "sgl-project/SpecForge", "a6b6b0230009d15ec2a97a57384e6f53f0f96946"
SPECULATORS_REPO, SPECULATORS_COMMIT = "vllm-project/speculators", "c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b"
ZLAB_REPO, ZLAB_COMMIT = "z-lab/dflash", "44947fbf71114e241c96de194f4b382b5dd330d0"


def _sf(path: str, line: int, needle: str, says: str) -> Cite:
    return Cite(SPECFORGE_REPO, SPECFORGE_COMMIT, path, line, needle, says)


def _sp(path: str, line: int, needle: str, says: str) -> Cite:
    return Cite(SPECULATORS_REPO, SPECULATORS_COMMIT, path, line, needle, says)


def _zl(path: str, line: int, needle: str, says: str) -> Cite:
    return Cite(ZLAB_REPO, ZLAB_COMMIT, path, line, needle, says)


SPECFORGE: dict[str, Cite] = {
    "key": _sf("specforge/algorithms/model_providers.py", 238, 'layers = list(method_config.get("target_layer_ids", []))',
               "resolve_dflash_capture_layers: the capture layers are the draft config's dflash_config.target_layer_ids "
               "(empty: ValueError), in list order"),
    "method": _sf("specforge/algorithms/dflash/providers.py", 201, 'capture_method="dflash",',
                  "the DFlash provider captures with capture_method 'dflash'"),
    "setter": _sf("specforge/offline_capture/sglang_backend/capture.py", 99, '"dflash": "set_dflash_layers_to_capture",',
                  "capture_method 'dflash' calls the SGLang target's set_dflash_layers_to_capture(layer_ids): the ids "
                  "mean what SGLang's DFlash setter makes them mean"),
}

SPECULATORS: dict[str, Cite] = {
    "key": _sp("src/speculators/models/dflash/config.py", 56, "aux_hidden_state_layer_ids: list[int] | None = Field(",
               "DFlashSpeculatorConfig.aux_hidden_state_layer_ids: the draft config's key"),
    "train": _sp("src/speculators/models/dflash/core.py", 218, '"aux_hidden_state_layer_ids": target_layer_ids,',
                 "training writes --target-layer-ids there (default [2, L//2, L-3], models/utils.py:52)"),
    "flag": _sp("src/speculators/train/config/schema.py", 115, "target_layer_ids: list[int] | None = Field(",
                "the training flag: pass the ids used to launch vLLM, without the final layer launch_vllm.py appends"),
    "datagen": _sp("scripts/launch_vllm.py", 140, '"hf_config": {"eagle_aux_hidden_state_layer_ids": target_layer_ids}',
                   "data generation hands the same ids to vLLM's eagle_aux_hidden_state_layer_ids unchanged: vLLM's "
                   "aux convention"),
    "last": _sp("scripts/launch_vllm.py", 122, "target_layer_ids.append(num_hidden_layers)",
                "--include-last-layer (default) appends id L, the verifier's last state, split off in training"),
    "zlab": _sp("src/speculators/convert/dflash/converter.py", 125,
                "i + 1 for i in target_layer_ids if i + 1 != num_verifier_layers",
                "the z-lab converter maps z-lab's target_layer_ids i to i + 1 and drops L"),
}

ZLAB: dict[str, Cite] = {
    "key": _zl("dflash/model.py", 313, '"target_layer_ids", build_target_layer_ids(config.num_target_layers,',
               "DFlashDraftModel: dflash_config.target_layer_ids, else build_target_layer_ids(num_target_layers, "
               "num_hidden_layers)"),
    "offset": _zl("dflash/model.py", 43, "offset = 1", "extract_context_feature reads hidden_states[layer_id + 1]"),
    "read": _zl("dflash/model.py", 44, "selected_states = [hidden_states[layer_id + offset] for layer_id in layer_ids]",
                "in list order, from the target's output_hidden_states (model.py:99): id k = layer_out[k], "
                "-1 the embedding (hidden_states[0]), L-1 the final norm's output (hidden_states[L])"),
}

TABLES = {"specforge": SPECFORGE, "speculators": SPECULATORS, "zlab": ZLAB}


def _zlab_offset() -> int:
    """z-lab reads ``hidden_states[layer_id + offset]``: the offset its cited line sets (``offset = 1``)."""
    name, _, value = ZLAB["offset"].needle.partition("=")
    assert name.strip() == "offset", ZLAB["offset"]
    return int(value)


def _zlab_to_id(point: Point, num_layers: int) -> int:
    offset = _zlab_offset()
    try:
        return HF.to_id(point, num_layers) - offset
    except NotExpressible as e:
        raise NotExpressible("zlab", f"{e.reason} (z-lab reads hidden_states[id + {offset}])", point) from None


def _zlab_to_point(index: int, num_layers: int) -> Point:
    offset = _zlab_offset()
    if not -offset <= index <= num_layers - offset:
        raise InvalidId(f"z-lab target_layer_id {index} is out of range for {num_layers} layers "
                        f"({-offset}..{num_layers - offset})")
    return HF.to_point(index + offset, num_layers)


ZLAB_CONV = PointwiseConvention(
    name="zlab",
    title="z-lab/dflash dflash_config.target_layer_ids (hidden_states[id + 1])",
    source=f"built-in table: {ZLAB['read']}",
    field="dflash_config.target_layer_ids",
    to_id=_zlab_to_id,
    to_point=_zlab_to_point,
    keeps_order=True,  # a list comprehension over the ids, in their order
)


def main(argv: list[str] | None = None) -> int:
    """``python -m surgeon.engines.facts.dflash_trainers specforge|speculators|zlab CHECKOUT``: the table
    against a checkout of that repository (exit 0 when it agrees, 3 listing what moved, 2 on bad arguments)."""
    from surgeon.engines.facts.field_tables import main as check

    return check(argv, TABLES)


if __name__ == "__main__":
    raise SystemExit(main())
