"""vLLM's Transformers backend (``--model-impl transformers``, issue 34 item 3), read from its source
and checked against the engine's own setter and forward on a real HF model.

Hand-read (vLLM 0.32.0 installed, 0.33.0, 0.34.0; the same code in each, at other lines):
- model_executor/models/transformers/base.py ``Base.set_aux_hidden_state_layers`` (0.34.0:843-863):
  ``for layer in layers: layer_name = self._layer_names[layer - 1]`` then
  ``OutputRecorder(target_class, layer_name=layer_name)`` registered under
  ``aux_hidden_state_{layer}``: id j hooks decoder layer j-1 and records its output, the residual
  stream after layer j-1 (layer_out[j-1], stream position j): the rule is +0 like the native
  classes. Id 0 looks up ``self._layer_names[-1]``: a KeyError (the dict is filled with keys
  0..L-1 at base.py:550, ``self._layer_names[int(child_name)]`` over the children of the
  ModuleList with ``text_config.num_hidden_layers`` entries): embed cannot be captured. Id L
  records the last layer's output, before the final norm.
- Nothing sorts: the recorders are registered in the ids' order and transformers' collector returns
  them in that order (``for k in capturable_flags``); ``Base.forward`` returns ``outputs[1:]``.
- The default is ``get_eagle3_default_aux_hidden_state_layers``: ``(2, L // 2, L - 3)`` through the rule.
- The table is filled by LENGTH: in a multimodal model a vision tower of the same depth would
  overwrite it, so the multimodal classes are unverified.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from surgeon.cli import main
from surgeon.engines.probes.probe import probe_engine
from tests.conftest import engine_matrix

ROOT = Path(__file__).resolve().parents[2]
# The vLLM releases of the matrix that have the backend's aux capture (0.11.0 has none).
RELEASES = {label: root for engine, label, root in engine_matrix()
            if engine == "vllm" and label != "vllm-0.11.0"}
FILE_LINE = re.compile(r"[\w/.-]+\.py:\d+")


def _spec(tmp_path: Path, points: list[str], L: int = 32, hidden: int = 4096, order: str = "a, b, c") -> Path:
    f = tmp_path / "spec.yaml"
    f.write_text(textwrap.dedent(f"""\
        spec: 1
        name: hfb
        target: {{architecture: LlamaForCausalLM, num_layers: {L}, hidden_size: {hidden}}}
        captures: {{a: '{points[0]}', b: '{points[1]}', c: '{points[2]}', last: final_norm}}
        draft: {{kind: eagle3, fc_input: [{order}], fc_in_features: {3 * hidden}}}
        """))
    return f


def _render(spec: Path, root: Path | None, model_class: str = "TransformersForCausalLM"):
    args = ["render", str(spec), "--engine", "vllm", "--model-class", model_class, "--json"]
    if root is not None:
        args += ["--engine-root", str(root)]
    return CliRunner().invoke(main, args)


def _line_text(root: Path | None, path: str, line: int) -> str:
    if root is None:
        from surgeon.engines.source.locate import locate_engine

        root = Path(locate_engine("vllm").root)
    return (root / path).read_text().splitlines()[line - 1]


@pytest.mark.parametrize("label", list(RELEASES))
def test_the_backend_classes_are_classified_from_the_setter(label):
    root = RELEASES[label]
    probe = probe_engine("vllm", root)
    backend = {k: cc for k, cc in probe.classes.items() if "/transformers/" in cc.path}
    assert len(backend) >= 15, sorted(backend)
    for cc in backend.values():
        assert cc.status == "classified", (cc.class_name, cc.reason)
        assert cc.id_rule is not None and cc.id_rule.name == "+0"
        assert [str(t) for t in cc.default or ()] == ["2", "L//2", "L-3"] and cc.default_through_rule
        assert not cc.sorts and cc.emit_order == "ids" and cc.capture_site == "exit"
        assert cc.reachable(32) == frozenset(range(1, 33)), cc.class_name  # never 0 (embed)
        recorder = next(s for s in cc.sites if s.where == "loop_exit")
        assert "OutputRecorder" in _line_text(root, recorder.path, recorder.line)
        lookup = next(s for s in cc.sites if s.where == "before_loop")
        assert "self._layer_names[layer - 1]" in _line_text(root, lookup.path, lookup.line)
        assert "KeyError" in (lookup.first_index_fails or "")
        multimodal = "MultiModal" in cc.class_name
        assert cc.verified is not multimodal, (cc.class_name, cc.unverified_reason)
        if multimodal:
            assert "vision tower" in (cc.unverified_reason or "")


CASES = {
    # points of a 32-layer llama, fc order, ids (None: refused)
    "base": (["layer_out[1]", "layer_out[15]", "layer_out[28]"], "a, b, c", [2, 16, 29]),
    "last": (["layer_out[1]", "layer_out[15]", "layer_out[31]"], "a, b, c", [2, 16, 32]),
    "order": (["layer_out[1]", "layer_out[15]", "layer_out[28]"], "b, a, c", [16, 2, 29]),
    "embed": (["embed", "layer_out[15]", "layer_out[28]"], "a, b, c", None),
}


@pytest.mark.parametrize("label", list(RELEASES))
@pytest.mark.parametrize("case", list(CASES))
def test_render_on_the_backend(tmp_path, label, case):
    points, order, want = CASES[case]
    res = _render(_spec(tmp_path, points, order=order), RELEASES[label])
    assert "Traceback" not in res.output
    if want is None:
        assert res.exit_code == 2, res.output
        assert "KeyError" in res.output and "transformers/base.py:" in res.output and FILE_LINE.search(res.output)
    else:
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["ids"] == want


# -- the engine's own code on a real model ------------------------------------------------------
# vLLM's Base.set_aux_hidden_state_layers and Base.forward (installed vLLM 0.32.0), run unbound on an
# object that carries what they read, with a real tiny HF LlamaModel as ``self.model``. The one
# thing not run from vLLM is the walk that names the layers (``_recursive_replace`` needs a whole
# engine): the table is what base.py:539 builds for a LlamaModel, qual_name "model.layers.k"
# without "model.". The recorded tensors are compared with surgeon's reference of the same model.

L_TINY = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import torch

    from surgeon.run.tinymodels import make_tiny_model
    from surgeon.verify.reference import capture_reference

    d = make_tiny_model("llama", tmp_path_factory.mktemp("hfb") / "m", num_layers=L_TINY, seed=5)
    ids = torch.arange(3, 19)
    return d, ids, capture_reference(d, ids)


@pytest.fixture
def engine_module(tiny):
    """What vLLM's Base holds for the tiny model. The setter writes the recorders into the HF
    model's ``_can_record_outputs``, which transformers keeps per CLASS (the registry of
    utils/output_capturing.py is keyed on the class): restored after each test, or one test's
    recorders would keep their place in the next (as they would in one vLLM process)."""
    import types

    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny[0], torch_dtype=torch.float32).eval()
    table = model._can_record_outputs
    saved = dict(table) if table is not None else None
    layers = model.layers
    yield types.SimpleNamespace(
        model=model, _target_class=type(layers[0]), _output_aux_hidden_states_kwargs={},
        _layer_names={k: f"layers.{k}" for k in range(len(layers))},
        pp_group=types.SimpleNamespace(is_first_rank=True, is_last_rank=True))
    if table is not None and saved is not None:
        table.clear()
        table.update(saved)


@pytest.mark.slow
@pytest.mark.parametrize("points,order", [(["layer_out[2]", "layer_out[0]", "layer_out[3]"], "a, b, c"),
                                          (["layer_out[0]", "layer_out[1]", "layer_out[3]"], "c, a, b")])
def test_the_rendered_ids_record_the_spec_points_through_vllms_own_code(tmp_path, tiny, engine_module, points, order):
    import torch
    from vllm.model_executor.models.transformers.base import Base

    _, ids, ref = tiny
    res = _render(_spec(tmp_path, points, L=L_TINY, hidden=ref.hidden_size, order=order), None)
    assert res.exit_code == 0, res.output
    rendered = json.loads(res.stdout)["ids"]
    Base.set_aux_hidden_state_layers(engine_module, tuple(rendered))
    with torch.no_grad():
        _, aux = Base.forward(engine_module, ids, torch.arange(len(ids)))
    names = dict(zip("abc", points))
    fc = [names[s.strip()] for s in order.split(",")]
    assert len(aux) == 3
    for got, point in zip(aux, fc):
        assert torch.allclose(got, ref[point], atol=1e-5), point


@pytest.mark.slow
def test_id_zero_is_a_key_error_in_vllms_setter(engine_module):
    from vllm.model_executor.models.transformers.base import Base

    with pytest.raises(KeyError):
        Base.set_aux_hidden_state_layers(engine_module, (0, 2))
