"""Suite-wide fixtures: real engine copies, the gpu skip, and the slow marker's meaning.

Engines come from one place. Tests that edit an engine work on a copy of the *installed* engine
(found with :mod:`surgeon.engines.source.locate`, never a hard-coded site-packages path), made by the
``engine_copy`` fixture below; a missing engine is a setup error that fails loudly, never a skip.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from surgeon.engines.source.locate import EngineLocation, ProbeError, locate_engine

pytest_plugins = ["pytester"]


def installed_engine(engine: str) -> EngineLocation:
    """The installed ``engine``, as every command finds it; fails (not skips) when it is absent,
    because scripts/setup installs both engines and a silently skipped suite proves nothing."""
    try:
        return locate_engine(engine)
    except ProbeError as e:
        pytest.fail(f"{engine} is not installed ({e}): run ./scripts/setup", pytrace=False)


RELEASES_DIR = Path(__file__).resolve().parents[1] / ".engines"
RELEASES_LIST = Path(__file__).resolve().parents[1] / "scripts" / "engine-releases.txt"


def engine_releases() -> list[tuple[str, str]]:
    """(distribution, version) of every release in scripts/engine-releases.txt, in file order."""
    out = []
    for line in RELEASES_LIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            dist, version = line.split()
            out.append((dist, version))
    return out


def release_engine(dist: str, version: str) -> Path:
    """The package directory of an engine release fetched as sources by scripts/fetch-engines
    (``.engines/vllm-0.33.0/vllm``); fails (not skips) when it was not fetched."""
    folder = RELEASES_DIR / f"{dist}-{version}"
    if not (folder / ".complete").exists():
        pytest.fail(f"{dist} {version} sources are not in {folder}: run ./scripts/setup", pytrace=False)
    return folder / dist.split("-")[0]


def engine_matrix() -> list[tuple[str, str, Path | None]]:
    """(engine, label, root) for the installed engines (root None) and every fetched release."""
    rows: list[tuple[str, str, Path | None]] = [("vllm", "vllm-installed", None), ("sglang", "sglang-installed", None)]
    for dist, version in engine_releases():
        rows.append((dist.split("-")[0], f"{dist}-{version}", RELEASES_DIR / f"{dist}-{version}" / dist.split("-")[0]))
    return rows


def cli_run(*args, code=0):
    """``surgeon ARGS`` in-process (click's runner): asserts the exit code and that no traceback
    reached the output, and returns the result."""
    from click.testing import CliRunner

    from surgeon.cli import main

    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == code, (res.exit_code, res.output, res.stderr)
    assert "Traceback" not in res.output
    return res


@pytest.fixture
def engine_copy(tmp_path: Path) -> Callable[..., Path]:
    """``engine_copy(engine, dest=None, metadata=True)``: a writable site-packages-like copy of
    the installed engine's model files under ``dest`` (default ``tmp_path/site-<engine>``); returns
    the copied package directory. ``metadata=False`` leaves out the ``*.dist-info`` (a copy whose
    version is unknown). Copies of both engines may share one ``dest``."""
    from surgeon.engines.source.locate import copy_engine_sources

    def make(engine: str, dest: str | Path | None = None, *, metadata: bool = True) -> Path:
        site = Path(dest) if dest is not None else tmp_path / f"site-{engine}"
        installed_engine(engine)
        before = set(site.glob("*.dist-info"))
        package = copy_engine_sources(engine, site)
        if not metadata:
            for info in set(site.glob("*.dist-info")) - before:
                shutil.rmtree(info)
        return package

    return make


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where CUDA exists; elsewhere they are skipped cleanly. torch
    is imported only when such a test is collected, so a run of the light tests never pays for it."""
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in gpu:
        item.add_marker(skip)


# -- TensorRT-LLM and Model Optimizer dumps, written as each source writes them ------------------------
# One home for the writers the subject readers' tests, dump-info's and export's use. The engine's own
# states are stood in for by a real reference (surgeon.verify.reference.Reference) of a tiny model: the
# HF tuple for the hf backend, vLLM's stream positions for the vllm backend (id j = the input of layer
# j), TensorRT-LLM's per-layer capture (hidden_states + residual, the output of layer k; -1 post-norm).
# torch is imported inside: the light tests never pay for it.
FIELD_LAYERS = 8
FIELD_IDS = list(range(5, 29))


@pytest.fixture(scope="session")
def field_target(tmp_path_factory):
    """(reference, reference file, spec file) of a tiny 8-layer llama: the spec captures layer_out[1],
    [3], [5] (its fc input, in order) and final_norm."""
    import textwrap

    from surgeon.run.tinymodels import make_tiny_model
    from surgeon.verify.reference import capture_reference, save_reference

    d = tmp_path_factory.mktemp("field-target")
    model = make_tiny_model("llama", d / "model", num_layers=FIELD_LAYERS, seed=3)
    ref = capture_reference(model, FIELD_IDS)
    ref_file = d / "ref.safetensors"
    save_reference(ref, ref_file)
    spec = d / "spec.yaml"
    spec.write_text(textwrap.dedent(f"""\
        spec: 1
        name: tiny
        target: {{architecture: LlamaForCausalLM, num_layers: {FIELD_LAYERS}, hidden_size: 64}}
        captures: {{low: 'layer_out[1]', mid: 'layer_out[3]', high: 'layer_out[5]', last: final_norm}}
        draft: {{kind: eagle3, fc_input: [low, mid, high], fc_in_features: 192}}
        """))
    return ref, ref_file, spec


def hf_outputs_hidden_states(ref):
    """transformers' output_hidden_states tuple: embed, layer_out[0..L-2], then the final norm's output."""
    from surgeon.core.points import EMBED, FINAL_NORM, layer_out

    L = ref.num_layers
    return tuple(ref.states[p][None] for p in [EMBED, *(layer_out(k) for k in range(L - 1)), FINAL_NORM])


def write_modelopt_hf(path, ref, selected_layer_ids, conversation_id=7):
    # NVIDIA/Model-Optimizer@a2fbac7 examples/speculative_decoding/collect_hidden_states/compute_hidden_states_hf.py
    import torch

    hidden_states = hf_outputs_hidden_states(ref)  # :185 hidden_states = outputs.hidden_states
    aux_hidden_states = torch.cat(  # :186-188
        [hidden_states[lid + 1].squeeze(0).cpu() for lid in selected_layer_ids], dim=-1
    )
    output_hidden_states = hidden_states[-1].squeeze(0).cpu()  # :189
    input_ids = ref.input_ids[None]
    loss_mask = torch.ones(ref.input_ids.numel(), dtype=torch.long)  # common.py tokenize_with_loss_mask: LongTensor
    torch.save({"input_ids": input_ids.squeeze(0).cpu(), "hidden_states": output_hidden_states,  # :193-201
                "aux_hidden_states": aux_hidden_states, "loss_mask": loss_mask,
                "conversation_id": conversation_id}, path)
    return path


def write_modelopt_vllm(path, ref, aux_layer_ids, conv_id="c1"):
    # NVIDIA/Model-Optimizer@a2fbac7 .../compute_hidden_states_vllm.py
    import torch

    from surgeon.core.points import Point

    extract_layer_ids = [*aux_layer_ids, ref.num_layers]  # :178
    # the connector's hidden_states [T, n, H] in extract_layer_ids order (:292-295); vLLM id j is the
    # residual stream entering layer j (surgeon's vLLM table), id L the last layer's output, pre-norm
    obj = {"token_ids": ref.input_ids.clone(),
           "hidden_states": torch.stack([ref.states[Point.at_position(j)] for j in extract_layer_ids], dim=1)}
    token_ids = obj["token_ids"]
    hidden_states = obj["hidden_states"]
    output_hidden_states = hidden_states[:, -1, :].cpu()  # :297
    if hidden_states.shape[1] > 1:  # :298-303
        aux = hidden_states[:, :-1, :].cpu()
        aux_hidden_states = aux.reshape(aux.shape[0], -1)
    else:
        aux_hidden_states = torch.empty(0)
    loss_mask = torch.ones(ref.input_ids.numel() + 2, dtype=torch.long)
    torch.save({"input_ids": token_ids.cpu(), "hidden_states": output_hidden_states,  # :317-325
                "aux_hidden_states": aux_hidden_states,
                "loss_mask": loss_mask[: output_hidden_states.shape[0]].cpu(), "conversation_id": conv_id}, path)
    return path


def trtllm_record(ref, eagle3_layers_to_capture, *, last_hidden_in_save=False, aux_key="aux_hidden_states", record_id=1):
    """One record of NVIDIA/TensorRT-LLM@3e906a0 tensorrt_llm/_torch/speculative/save_hidden_state.py."""
    import torch

    from surgeon.core.points import EMBED, FINAL_NORM, layer_out

    layers = sorted(set(eagle3_layers_to_capture))  # eagle3.py:139, then -1 moved last (:140)
    if layers[0] == -1:
        layers = layers[1:] + [-1]
    if -1 not in layers:  # SaveHiddenStatesDecodingConfig adds -1 (llm_args.py model_post_init)
        layers.append(-1)
    H = ref.states[EMBED].shape[1]
    # the capture buffer: column block i holds layers[i] (eagle3.py:217 hidden_states + residual = layer_out[k])
    buffer = torch.cat([ref.states[FINAL_NORM if k == -1 else layer_out(k)] for k in layers], dim=-1)
    input_ids = torch.tensor(list(ref.input_ids.tolist()), dtype=torch.long, device="cpu")  # :36-38
    num_tokens = input_ids.shape[0]
    hidden_states = buffer[:num_tokens, -H:].cpu().clone()  # :41-43
    out_dict = {"id": record_id, "input_ids": input_ids, "hidden_state": hidden_states}  # :45-49
    if len(layers) > 1:  # :50-61
        out_dict[aux_key] = (buffer[:num_tokens, :] if last_hidden_in_save else buffer[:num_tokens, :-H]).cpu().clone()
    return out_dict


def write_trtllm(path, ref, layers, **kw):
    import torch

    torch.save([trtllm_record(ref, layers, **kw)], path)  # :69 torch.save(self._saved_state, output_path)
    return path


def write_modelopt_trtllm(path, ref, aux_ids, conversation_id=3):
    # NVIDIA/Model-Optimizer@a2fbac7 .../compute_hidden_states_trtllm.py:236-241, on TensorRT-LLM's file
    import torch

    trtllm_dumped = [trtllm_record(ref, set(aux_ids))]
    trtllm_dumped = trtllm_dumped[0]
    trtllm_dumped.pop("id")
    trtllm_dumped["conversation_id"] = conversation_id
    trtllm_dumped["hidden_states"] = trtllm_dumped.pop("hidden_state")
    torch.save(trtllm_dumped, path)
    return path


# -- the norm-flag tests' tiny spec and draft-file copies -----------------------------------------
NORMS_SPEC = """\
spec: 1
name: tiny
target: {architecture: LlamaForCausalLM, num_layers: 8, hidden_size: 64}
captures:
  low: layer_out[1]
  mid: layer_out[3]
  high: layer_out[5]
EXTRAdraft: {kind: eagle3, fc_input: [low, mid, high]TAIL}
"""


def norms_spec(tmp_path: Path, norms: str = "", *, tail: str | None = None, captures: str = "") -> Path:
    """``tmp_path/s.yaml``: the tiny 8-layer Llama EAGLE-3 spec of the norm-flag tests. ``norms``:
    the inside of ``draft.norms`` (``"fc_norm: true"``; empty: no norms); ``tail``: raw text after the
    fc_input list instead (bad input); ``captures``: more capture lines (``"last: final_norm"``)."""
    f = tmp_path / "s.yaml"
    tail = tail if tail is not None else f", norms: {{{norms}}}" if norms else ""
    extra = "".join(f"  {line}\n" for line in captures.splitlines())
    f.write_text(NORMS_SPEC.replace("EXTRA", extra).replace("TAIL", tail))
    return f


def vllm_models_copy(tmp_path: Path, *files: str, version: str = "0.33.0") -> tuple[Path, list[Path]]:
    """A vLLM engine root under ``tmp_path/vllm`` holding the release's model registry and ``files``
    (names under model_executor/models) copied from ``.engines``: (root, the copied files)."""
    src = release_engine("vllm", version) / "model_executor" / "models"
    models = tmp_path / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    out = []
    for name in ("registry.py", *files):
        shutil.copy(src / name, models / name)
        out.append(models / name)
    return tmp_path / "vllm", out[1:]


def tiny_spec(tmp_path: Path, body: str = "", name: str = "s.yaml", fc: str = "[low, mid, high]",
              points: tuple[str, str, str] = ("layer_out[1]", "layer_out[3]", "layer_out[5]"),
              kind: str = "eagle3", architecture: str = "LlamaForCausalLM") -> Path:
    """``tmp_path/name``: a tiny 8-layer spec of ``architecture`` (captures low, mid, high at ``points``
    and last = final_norm; a ``kind`` draft reading ``fc``, which may name ``last``), then ``body``."""
    import textwrap

    f = tmp_path / name
    n = len(fc.strip("[]").split(","))
    f.write_text(textwrap.dedent(f"""\
        spec: 1
        name: tiny
        target: {{architecture: {architecture}, num_layers: 8, hidden_size: 64}}
        captures:
          low: {points[0]}
          mid: {points[1]}
          high: {points[2]}
          last: final_norm
        draft: {{kind: {kind}, fc_input: {fc}, fc_in_features: {64 * n}}}
        """) + body)
    return f


def default_sigint() -> None:
    """``preexec_fn`` for a child a test interrupts as a terminal would: SIGINT back to its default
    disposition. A shell without job control starts background commands with SIGINT ignored, and
    Python then installs no KeyboardInterrupt handler: a Ctrl-C test run from such a CI job would
    otherwise send its signal into the void."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
