"""Built-in tables for the tools whose source is not pip-downloadable here, each fact citing the
repository, commit, file and line it was read from; and their id conventions.

TensorRT-LLM: on PyPI ``tensorrt_llm`` 1.2.1 is a 10 kB sdist stub whose build fetches the real
wheel from pypi.nvidia.com (unreachable here), and no release 0.21.0-1.2.1 has a PyPI wheel for
any platform (measured with ``pip download --no-deps --only-binary=:all:``): its source cannot be
fetched in setup, so its rules below were read once from GitHub (NVIDIA/TensorRT-LLM, the commits
named per fact, through a stored-source index; line numbers counted in that stored text).

Model Optimizer's collection scripts (examples/speculative_decoding/collect_hidden_states) are not
in its wheel either; they were read from NVIDIA/Model-Optimizer at commit a2fbac7 (2026-08-21,
version 0.47.0dev; the folder last changed 2026-08-12). Its library presets are probed from the
wheel instead (:mod:`surgeon.engines.facts.modelopt`).

:func:`check_against_source` compares each fact's ``needle`` with a source tree when one is given
(a TensorRT-LLM or Model-Optimizer checkout), so the table cannot drift silently from a release
someone has on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from surgeon.core.conventions import HF, InvalidId, NotExpressible, PointwiseConvention
from surgeon.core.idrules import DefaultTerm
from surgeon.core.points import FINAL_NORM, Point, layer_out
from surgeon.engines.source.reading import read_source

TRTLLM_REPO = "NVIDIA/TensorRT-LLM"
MODELOPT_REPO = "NVIDIA/Model-Optimizer"
MODELOPT_COMMIT = "a2fbac7bad8ab446d3f8783dadb0c3366eb0ad73"
COLLECT = "examples/speculative_decoding/collect_hidden_states"


@dataclass(frozen=True)
class Cite:
    """One fact read from a repository: ``needle`` is text the cited line holds (checked against a
    source tree by :func:`check_against_source`); ``line`` None where the line was not recorded."""

    repo: str
    commit: str
    path: str
    line: int | None
    needle: str
    says: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else f"{self.path} (line not recorded)"
        return f"{self.repo}@{self.commit[:7]} {where}: {self.says}"


_EAGLE3 = "tensorrt_llm/_torch/speculative/eagle3.py"
_E3 = "f933a608045a46426792263617475b359d568043"
_E3_ONE = "001e67005b4f64b69b0045456870be48ab7b2cf0"
_LLM_ARGS = "tensorrt_llm/llmapi/llm_args.py"
_ARGS = "0004396720054fd8e205cbf616f21f0b57c6b412"
# one layer is handled before the tuple, and each version differently: (1,) and () in early
# Eagle3SpecMetadata, (num_layers - 1,) and then (-1,) in later ones (read in GitHub's history, not pinned)
TRTLLM_ONE_LAYER = ("a 1-layer target's default differs between TensorRT-LLM versions ((1,), (), (0,) or (-1,)) "
                    "and is not in surgeon's table")
TRTLLM: dict[str, Cite] = {
    "default": Cite(TRTLLM_REPO, _E3, _EAGLE3, 136, "self.layers_to_capture = (1, self.num_layers // 2 - 1,",
                    "Eagle3SpecMetadata.__post_init__: no ids -> (1, num_layers // 2 - 1, num_layers - 4), "
                    "a tuple (not de-duplicated); 2 to 5 layers raise"),
    "sorted": Cite(TRTLLM_REPO, _E3, _EAGLE3, 139, "self.layers_to_capture = sorted(list(self.layers_to_capture))",
                   "given ids (a Set[int]: duplicates merge) are sorted: captures arrive in ascending id order"),
    "minus_one_last": Cite(TRTLLM_REPO, _E3, _EAGLE3, 140, "if self.layers_to_capture[0] == -1:",
                           "-1 is moved from the front to the last capture slot"),
    "value": Cite(TRTLLM_REPO, _E3, _EAGLE3, 217,
                  "to_save = hidden_states + residual if residual is not None else hidden_states",
                  "maybe_capture_hidden_states(layer_id, ...) stores hidden_states + residual for a listed layer_id"),
    "call": Cite(TRTLLM_REPO, "3a5901cd0d77bed18baaf402d1d12fab468d44a9", "tensorrt_llm/_torch/models/modeling_llama.py",
                 None, "spec_metadata.maybe_capture_hidden_states(self.layer_idx,",
                 "each decoder layer calls it with its own layer_idx at the end of its forward, after the MLP: "
                 "id k = the output of layer k (layer_out[k])"),
    "minus_one": Cite(TRTLLM_REPO, "unknown", "tensorrt_llm/llmapi/llm_args.py", None,
                      "Use -1 to indicate the final post-norm hidden state",
                      "SaveHiddenStatesDecodingConfig.eagle3_layers_to_capture: -1 is the final post-norm hidden "
                      "state, added when absent (model_post_init); where the engine captures -1 was not read"),
    "dump": Cite(TRTLLM_REPO, "17c59c369a8f180e95386d7d434136b68b95bfbb",
                 "tensorrt_llm/_torch/speculative/save_hidden_state.py", None, '"hidden_state": hidden_states',
                 "SaveHiddenStatesDrafter writes torch.save(list of {id, input_ids, hidden_state [T,H] = the last "
                 "capture slot, aux [T, n*H]}) to {file_prefix}_{iter}.pt; the aux key is 'hidden_state_features' "
                 "in some versions and 'aux_hidden_states' in others"),
    # What `surgeon render --engine trtllm` writes: EagleDecodingConfig's fields and what its one-model
    # path (the only path at _ARGS) does with the ids.
    "fields": Cite(TRTLLM_REPO, _ARGS, _LLM_ARGS, None, "eagle3_layers_to_capture: Optional[Set[int]] = Field(",
                   "EagleDecodingConfig (decoding_type Literal['Eagle']; max_draft_len > 0; eagle3_one_model, default "
                   "True): eagle3_layers_to_capture is an Optional[Set[int]] of target layer indices, default "
                   "{1, num_layers//2-1, num_layers-4}"),
    "model_dir": Cite(TRTLLM_REPO, _ARGS, _LLM_ARGS, None, '"speculative_model_dir"),',
                      "DecodingBaseConfig.speculative_model takes the alias speculative_model_dir (AliasChoices)"),
    "one_model_only": Cite(TRTLLM_REPO, _ARGS, _LLM_ARGS, None, '"ignored; falling back to eagle3_one_model=True. "',
                           "validate_eagle_config: eagle3_one_model=False is deprecated and ignored; the one-model "
                           "path runs"),
    "one_model_sorts": Cite(TRTLLM_REPO, _E3_ONE, _EAGLE3, None, "class Eagle3OneModelSpecMetadata(SpecMetadata):",
                            "Eagle3OneModelSpecMetadata.__post_init__: given ids are sorted(list(...)) and -1 stays "
                            "where it sorts (first); only the two-model Eagle3SpecMetadata of some versions moves it last"),
    "arch_minus_one": Cite(TRTLLM_REPO, _ARGS, _LLM_ARGS, None, "self.eagle3_layers_to_capture = {-1}",
                           "validate_eagle_config: eagle3_model_arch mistral_large3 without ids uses {-1}, the last "
                           "state alone"),
}

_HF_SCRIPT = f"{COLLECT}/compute_hidden_states_hf.py"
_VLLM_SCRIPT = f"{COLLECT}/compute_hidden_states_vllm.py"
_TRT_SCRIPT = f"{COLLECT}/compute_hidden_states_trtllm.py"
_COMMON = f"{COLLECT}/common.py"
MODELOPT: dict[str, Cite] = {
    "common_presets": Cite(MODELOPT_REPO, MODELOPT_COMMIT, _COMMON, 59, "return default_eagle_aux_layer_ids(num_hidden_layers)",
                           "resolve_aux_layers: 'eagle' -> the library's default_eagle_aux_layer_ids, 'dflash' -> "
                           "sorted(set(build_target_layer_ids(L, 5))), else a list checked 0 <= i < L, sorted, de-duplicated"),
    "hf_aux": Cite(MODELOPT_REPO, MODELOPT_COMMIT, _HF_SCRIPT, 187, "hidden_states[lid + 1]",
                   "hf backend: aux id k reads outputs.hidden_states[k + 1] (the output of layer k; for k = L-1 that "
                   "entry is the final norm's output)"),
    "hf_last": Cite(MODELOPT_REPO, MODELOPT_COMMIT, _HF_SCRIPT, 189, "output_hidden_states = hidden_states[-1]",
                    "hf backend: the dump's hidden_states is outputs.hidden_states[-1], the final norm's output"),
    "dump": Cite(MODELOPT_REPO, MODELOPT_COMMIT, _HF_SCRIPT, 193, "torch.save(",
                 "hf backend: one {conversation_id}.pt per conversation: input_ids, hidden_states, "
                 "aux_hidden_states, loss_mask, conversation_id (the vllm script writes the same keys)"),
    "vllm_ids": Cite(MODELOPT_REPO, MODELOPT_COMMIT, _VLLM_SCRIPT, 178,
                     "extract_layer_ids = [*aux_layer_ids, num_hidden_layers]",
                     "vllm backend: the same 0-based aux ids, then L for the last slot"),
    "vllm_config": Cite(MODELOPT_REPO, MODELOPT_COMMIT, _VLLM_SCRIPT, 262,
                        '"hf_config": {"eagle_aux_hidden_state_layer_ids": extract_layer_ids}',
                        "vllm backend: passes them unchanged as vLLM's eagle_aux_hidden_state_layer_ids "
                        "(speculative method extract_hidden_states)"),
    "vllm_presets": Cite(MODELOPT_REPO, MODELOPT_COMMIT, _VLLM_SCRIPT, 68, "spec = aux_layers.strip().lower()",
                         "vllm backend: _resolve_aux_layers_standalone takes 'dflash' (an inline copy of "
                         "build_target_layer_ids) or an int list (0 <= i < L); 'eagle', the flag's default, is "
                         "not accepted there (int('eagle') raises)"),
    "vllm_range": Cite(MODELOPT_REPO, MODELOPT_COMMIT, _VLLM_SCRIPT, 78,
                       "out_of_range = [i for i in ids if not 0 <= i < num_hidden_layers]",
                       "vllm backend: an --aux-layers id outside [0, L) is refused"),
    "vllm_last": Cite(MODELOPT_REPO, MODELOPT_COMMIT, _VLLM_SCRIPT, 297, "output_hidden_states = hidden_states[:, -1, :]",
                      "vllm backend: the dump's hidden_states is the slot of id L"),
    "trtllm_ids": Cite(MODELOPT_REPO, MODELOPT_COMMIT, _TRT_SCRIPT, 201,
                       '"eagle3_layers_to_capture": set(resolve_aux_layers(args, num_hidden_layers))',
                       "trtllm backend: the same 0-based ids, unchanged, as SaveHiddenStatesDecodingConfig's "
                       "eagle3_layers_to_capture (which adds -1, the post-norm last state)"),
    "trtllm_rename": Cite(MODELOPT_REPO, MODELOPT_COMMIT, _TRT_SCRIPT, 238,
                          'trtllm_dumped["hidden_states"] = trtllm_dumped.pop("hidden_state")',
                          "trtllm backend: renames TRT-LLM's hidden_state to hidden_states, other keys kept"),
}


# ---------------------------------------------------------------------------------------------
# Conventions
# ---------------------------------------------------------------------------------------------
def _trtllm_to_id(point: Point, num_layers: int) -> int:
    if point.kind == "final_norm":
        return -1
    if point.kind == "layer_out":
        assert point.index is not None
        return point.index
    if point.kind == "embed":
        raise NotExpressible("trtllm", "ids are decoder layers, each captured at the end of its forward; "
                             "nothing captures before layer 0", point)
    raise NotExpressible("trtllm", "eagle3_layers_to_capture names layer outputs (and -1) only", point)


def _trtllm_to_point(index: int, num_layers: int) -> Point:
    if index == -1:
        return FINAL_NORM
    if not 0 <= index <= num_layers - 1:
        raise InvalidId(f"TensorRT-LLM layer id {index} is out of range for {num_layers} layers (0..{num_layers - 1}, -1)")
    return layer_out(index)


TRTLLM_CONV = PointwiseConvention(
    name="trtllm",
    title="TensorRT-LLM eagle3_layers_to_capture (PyTorch backend)",
    source=f"built-in table: {TRTLLM['call']}; {TRTLLM['sorted']}",
    field="speculative_config.eagle3_layers_to_capture",
    to_id=_trtllm_to_id,
    to_point=_trtllm_to_point,
    keeps_order=False,
    default=(DefaultTerm(0, 1, 1), DefaultTerm(1, 2, -1), DefaultTerm(1, 1, -4)),
)


def _modelopt_hf_to_id(point: Point, num_layers: int) -> int:
    if point.kind == "embed":
        raise NotExpressible("modelopt-hf", "aux ids are 0..L-1 and read hidden_states[id + 1]: the embedding "
                             "(hidden_states[0]) is not reachable", point)
    try:
        return HF.to_id(point, num_layers) - 1
    except NotExpressible as e:
        raise NotExpressible("modelopt-hf", e.reason, point) from None


def _modelopt_hf_to_point(index: int, num_layers: int) -> Point:
    if not 0 <= index < num_layers:
        raise InvalidId(f"--aux-layers index {index} is out of range [0, {num_layers}) (common.py refuses it)")
    return HF.to_point(index + 1, num_layers)


MODELOPT_HF = PointwiseConvention(
    name="modelopt-hf",
    title="Model Optimizer --aux-layers, hf backend (compute_hidden_states_hf.py)",
    source=f"built-in table: {MODELOPT['hf_aux']}",
    field="--aux-layers",
    to_id=_modelopt_hf_to_id,
    to_point=_modelopt_hf_to_point,
    keeps_order=False,  # resolve_aux_layers sorts and de-duplicates
)


def _modelopt_trt_to_id(point: Point, num_layers: int) -> int:
    if point.kind == "final_norm":
        raise NotExpressible("modelopt-trtllm", "--aux-layers takes 0 <= i < L; the post-norm state is the "
                             "dump's hidden_states (TRT-LLM's -1, added by SaveHiddenStatesDecodingConfig)", point)
    try:
        return _trtllm_to_id(point, num_layers)
    except NotExpressible as e:  # the same rule, named as the convention the user reads
        raise NotExpressible("modelopt-trtllm", e.reason, point) from None


MODELOPT_TRTLLM = PointwiseConvention(
    name="modelopt-trtllm",
    title="Model Optimizer --aux-layers, trtllm backend (compute_hidden_states_trtllm.py)",
    source=f"built-in table: {MODELOPT['trtllm_ids']}",
    field="--aux-layers",
    to_id=_modelopt_trt_to_id,
    to_point=lambda i, n: _trtllm_to_point(i, n) if i >= 0 else _modelopt_hf_to_point(i, n),
    keeps_order=False,
)

# What each Model Optimizer backend writes as the dump's hidden_states (the last state), per the table.
MODELOPT_LAST = {"hf": ("final_norm", MODELOPT["hf_last"]), "trtllm": ("final_norm", TRTLLM["minus_one"]),
                 "vllm": ("layer_out[L-1]", MODELOPT["vllm_last"])}


def check_against_source(cites: dict[str, Cite], root: str | Path) -> list[str]:
    """Each fact whose file is under ``root`` but whose needle is not on the cited line (or, with
    no line recorded, nowhere in the file): one line each; empty when the source agrees. Files
    absent from ``root`` are listed too: a tree that lacks the cited file cannot confirm it."""
    problems = []
    for key, cite in cites.items():
        path = Path(root) / cite.path
        if not path.is_file():
            problems.append(f"{key}: {cite.path} is not under {root}")
            continue
        lines = read_source(path).splitlines()
        if cite.line is not None:
            here = lines[cite.line - 1] if cite.line <= len(lines) else ""
            if cite.needle not in here:
                where = [i + 1 for i, text in enumerate(lines) if cite.needle in text]
                problems.append(f"{key}: {cite.path}:{cite.line} does not hold {cite.needle!r}"
                                + (f" (found at line {', '.join(map(str, where))})" if where else " (not in the file)"))
        elif not any(cite.needle in text for text in lines):
            problems.append(f"{key}: {cite.path} does not hold {cite.needle!r}")
    return problems


def main(argv: list[str] | None = None, tables: dict[str, dict[str, Cite]] | None = None) -> int:
    """``python -m surgeon.engines.facts.field_tables trtllm|modelopt ROOT``: check a table against a
    checkout (exit 0 when it agrees, 3 listing what moved or is missing, 2 on bad arguments).
    ``tables``: another module's tables (the DFlash trainers' :func:`surgeon.engines.facts.dflash_trainers.main`)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    tables = tables or {"trtllm": TRTLLM, "modelopt": MODELOPT}
    if len(args) != 2 or args[0] not in tables or not Path(args[1]).is_dir():
        print(f"usage: python -m surgeon.engines.facts.<field_tables|dflash_trainers> {'|'.join(tables)} SOURCE_DIR",
              file=sys.stderr)
        return 2
    problems = check_against_source(tables[args[0]], args[1])
    for p in problems:
        print(p)
    print(f"{args[0]}: {len(tables[args[0]]) - len(problems)} of {len(tables[args[0]])} facts confirmed in {args[1]}")
    return 3 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
