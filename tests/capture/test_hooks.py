"""CUDA-graph-safe capture hooks: generation, the static checker, torch.compile(fullgraph=True)
with zero graph breaks, equality with eager captures and with the transformers reference, and
(on a CUDA machine) capture into a CUDA graph and replay on new inputs."""

from __future__ import annotations

import ast
import itertools
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
libcst = pytest.importorskip("libcst")

from surgeon.capture.graphsafe import check_file, check_source  # noqa: E402
from surgeon.capture.hooks import generate_hooks_module, load_hooks_module  # noqa: E402
from surgeon.core.points import parse_point  # noqa: E402
from surgeon.core.spec import load_spec  # noqa: E402

SPECS = sorted((Path(__file__).resolve().parents[2] / "specs").glob("*.yaml"))
_counter = itertools.count()

TINY_SPEC = """\
spec: 1
name: tiny-llama.hooks
target: {architecture: LlamaForCausalLM, num_layers: 4, hidden_size: 64, model_type: llama}
captures:
  low: layer_out[0]
  emb: embed
  high: layer_out[2]
  top: layer_out[3]
  last: final_norm
draft: {kind: eagle3, fc_input: [high, emb, low], fc_in_features: 192}
"""


def tiny_spec():
    return load_spec("tiny.yaml", text=TINY_SPEC)


def hooks_for(spec, mode, max_tokens=32):
    return load_hooks_module(generate_hooks_module(spec, mode=mode, max_tokens=max_tokens),
                             f"_surgeon_hooks_test_{next(_counter)}")


def close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


# -- generation and the checker ---------------------------------------------------------------

@pytest.mark.parametrize("mode", ["aux", "dump"])
@pytest.mark.parametrize("spec_path", SPECS, ids=lambda p: p.stem)
def test_generated_module_parses_compiles_and_passes_the_checker(spec_path, mode):
    spec = load_spec(spec_path)
    src = generate_hooks_module(spec, mode=mode, max_tokens=256)
    ast.parse(src)
    compile(src, "<hooks>", "exec")
    assert check_source(src, "<hooks>") == []
    mod = hooks_for(spec, mode)
    assert mod.SPEC_NAME == spec.name and mod.SPEC_SHA256 == spec.sha256 and mod.MODE == mode
    names = spec.fc_names if mode == "aux" else spec.dump_slots
    assert list(mod.NAMES) == names
    assert list(mod.POINTS) == [str(spec.captures[n]) for n in names]
    for pos, slots in mod.POSITION_SLOTS.items():
        assert all(spec.captures[names[s]].position == pos for s in slots)
    assert hasattr(mod, "aux_hidden_states") == (mode == "aux")


def test_generation_refuses_bad_arguments(tmp_path):
    spec = tiny_spec()
    with pytest.raises(ValueError, match="mode"):
        generate_hooks_module(spec, mode="both", max_tokens=8)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_tokens"):
            generate_hooks_module(spec, mode="aux", max_tokens=bad)
    no_draft = load_spec("x.yaml", text=TINY_SPEC.split("draft:")[0])
    with pytest.raises(ValueError, match="fc_input"):
        generate_hooks_module(no_draft, mode="aux", max_tokens=8)
    generate_hooks_module(no_draft, mode="dump", max_tokens=8)


def test_spec_values_enter_as_literal_nodes_only():
    src = generate_hooks_module(tiny_spec(), mode="dump", max_tokens=8)
    tree = ast.parse(src)
    consts = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
              if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id.isupper()}
    assert consts["NAMES"] == ("low", "emb", "high", "top", "last")
    assert consts["POSITION_SLOTS"] == {0: (1,), 1: (0,), 3: (2,), 4: (3,)}
    assert consts["FINAL_SLOTS"] == (4,)
    assert consts["MAX_TOKENS"] == 8 and consts["HIDDEN_SIZE"] == 64


UNSAFE_ITEM = '''
import torch

def capture_position(module, position: int, hidden_states, residual=None):
    peak = hidden_states.abs().max().item()
    if peak > 100.0:
        return hidden_states * 0
    return hidden_states
'''

UNSAFE_SAVE = '''
import torch

def capture_position(module, position: int, hidden_states, residual=None):
    torch.save(hidden_states, "/nonexistent/surgeon-capture.pt")
    return hidden_states * 2
'''


def _load_user(src):
    return load_hooks_module(src, f"_surgeon_user_hook_{next(_counter)}")


@pytest.mark.parametrize("src, expected", [
    (UNSAFE_ITEM, [(5, "host-sync"), (6, "tensor-branch")]),
    (UNSAFE_SAVE, [(5, "io")]),
], ids=["item", "save"])
@pytest.mark.slow  # torch.compile(fullgraph=True) per case
def test_unsafe_hook_is_caught_by_the_checker_and_by_fullgraph_compile(src, expected, tmp_path):
    # (torch 2.13's dynamo traces an .item() whose value only feeds tensor arithmetic without a
    # graph break; the checker flags every .item(), and a branch on it breaks fullgraph)
    findings = check_source(src, "user.py")
    assert [(f.line, f.rule) for f in findings] == expected
    (tmp_path / "user.py").write_text(src)
    assert [(f.line, f.rule) for f in check_file(tmp_path / "user.py")] == expected
    assert str(findings[0]).startswith(f"user.py:{expected[0][0]}:")
    hook = _load_user(src).capture_position

    def step(x):
        return hook(None, 1, torch.sin(x)) + 1

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):  # Unsupported / UserError: no single graph
        torch.compile(step, fullgraph=True, backend="eager")(torch.randn(4, 8))
    assert not Path("/nonexistent/surgeon-capture.pt").exists()


def test_checker_rules_and_exemptions():
    src = '''
import torch, time, random

def hook(module, position: int, hidden_states, residual=None):
    x = hidden_states.sum(0)
    if x[0] > 0:
        pass
    if hidden_states.any():
        pass
    while residual:
        pass
    if residual is None or position > 3 or hidden_states.shape[0] > 2 or hidden_states.dim() == 2:
        pass
    print("hello")
    hidden_states.cpu(); hidden_states.tolist(); hidden_states.numpy()
    hidden_states.to("cpu"); hidden_states.to(device=torch.device("cpu")); hidden_states.to("cuda")
    torch.load("x"); open("y")
    time.perf_counter(); random.random()
    torch.cat([hidden_states]); torch.empty(3)
    y = hidden_states if residual is None else residual

def _alloc_buffers(module, like):
    return torch.zeros(3), torch.empty_like(like)

def drain(module, num_tokens=None):
    if num_tokens:
        return [torch.stack([])]
'''
    got = [(f.line, f.rule) for f in check_source(src)]
    assert got == [
        (6, "tensor-branch"), (8, "tensor-branch"), (10, "tensor-branch"), (14, "print"),
        (15, "host-sync"), (15, "host-sync"), (15, "host-sync"), (16, "host-sync"), (16, "host-sync"),
        (17, "io"), (17, "io"), (18, "nondeterminism"), (18, "nondeterminism"), (19, "alloc"), (19, "alloc"),
    ]
    assert check_source("def f(:\n")[0].rule == "syntax"


# -- a plain decoder-like loop carrying the residual separately (vLLM / SGLang style) ---------

class _Layer(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.proj = torch.nn.Linear(h, h)

    def forward(self, hidden_states, residual):
        residual = hidden_states if residual is None else hidden_states + residual
        return self.proj(self.norm(residual)), residual


class _Stack(torch.nn.Module):
    """Calls the hooks exactly where the patch puts them; ``first_layer`` models a pipeline
    stage that owns layers first_layer.. only."""

    def __init__(self, hooks, num_layers, h, first_layer=0):
        super().__init__()
        self.hooks = hooks
        self.first = first_layer
        self.layers = torch.nn.ModuleList(_Layer(h) for _ in range(num_layers))
        self.norm = torch.nn.LayerNorm(h)

    def forward(self, x):
        hooks = self.hooks
        hooks.begin_step(self, x.shape[0])
        hidden_states, residual = x, None
        if self.first == 0:
            hooks.capture_position(self, 0, hidden_states, residual)
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(hidden_states, residual)
            hooks.capture_position(self, self.first + i + 1, hidden_states, residual)
        out = self.norm(hidden_states + residual)
        hooks.capture_final(self, out)
        return out


def _manual_states(stack, x):
    """Every residual-stream state of _Stack, by hand."""
    states = [x]
    h, r = x, None
    for layer in stack.layers:
        h, r = layer(h, r)
        states.append(h + r)
    return states, stack.norm(h + r)


@pytest.mark.slow  # torch.compile
def test_residual_stream_loop_compiles_with_zero_graph_breaks_and_matches_eager():
    spec = tiny_spec()
    torch.manual_seed(0)
    for mode in ("aux", "dump"):
        hooks = hooks_for(spec, mode)
        stack = _Stack(hooks, 4, 64).eval()
        x1, x2 = torch.randn(7, 64), torch.randn(7, 64)
        with torch.no_grad():
            stack(x1)  # eager warm-up: allocates the buffers
            buf = hooks._state(stack).buf
            eager = [(n, p, t.clone()) for n, p, t in hooks.drain(stack)]
            torch._dynamo.reset()
            explain = torch._dynamo.explain(stack)(x2)
            assert explain.graph_break_count == 0 and explain.graph_count == 1
            compiled = torch.compile(stack, fullgraph=True, backend="aot_eager")
            compiled(x2)
            compiled(x1)
            assert hooks._state(stack).buf is buf  # no reallocation
            again = hooks.drain(stack)
            states, final = _manual_states(stack, x1)
        assert [(n, p) for n, p, _ in again] == [(n, p) for n, p, _ in eager]
        for (name, point, a), (_, _, b) in zip(eager, again):
            assert torch.equal(a, b), name
            pt = parse_point(point, 4)
            want = final if pt.kind == "final_norm" else states[pt.position]
            assert close(a, want), name
        if mode == "aux":
            with torch.no_grad():
                aux = hooks.aux_hidden_states(stack)
            assert aux.shape == (7, 3 * 64)
            assert torch.equal(aux, torch.cat([states[3], states[0], states[1]], dim=1))


def test_pipeline_stage_drains_only_the_positions_it_saw_and_tp_ranks_other_than_the_writer_drain_nothing(monkeypatch):
    spec = tiny_spec()
    hooks = hooks_for(spec, "dump")
    stage = _Stack(hooks, 2, 64, first_layer=2).eval()  # layers 2, 3: positions 3, 4 and the norm
    with torch.no_grad():
        stage(torch.randn(5, 64))
    assert [n for n, _, _ in hooks.drain(stage)] == ["high", "top", "last"]
    assert all(t.shape == (5, 64) for _, _, t in hooks.drain(stage))
    assert [t.shape[0] for _, _, t in hooks.drain(stage, 3)] == [3] * 3
    assert hooks.drain(torch.nn.Linear(1, 1)) == []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    assert hooks.drain(stage) == []
    assert len(hooks.drain(stage, writer_rank=1)) == 3


def test_a_slot_written_in_an_earlier_step_but_not_this_one_is_not_drained():
    # e.g. vLLM's profile run writes every slot; a later pipeline rank's real steps do not
    # capture embed, a non-last rank's do not capture the final norm
    spec = tiny_spec()
    hooks = hooks_for(spec, "dump")
    owner = torch.nn.Module()
    hooks.begin_step(owner, 3)
    hooks.capture_position(owner, 0, torch.ones(3, 64))
    hooks.capture_position(owner, 3, torch.ones(3, 64))
    hooks.capture_final(owner, torch.ones(3, 64))
    assert [n for n, _, _ in hooks.drain(owner)] == ["emb", "high", "last"]
    hooks.begin_step(owner, 2)
    hooks.capture_position(owner, 3, torch.full((2, 64), 2.0))
    got = hooks.drain(owner)
    assert [n for n, _, _ in got] == ["high"]
    assert torch.equal(got[0][2], torch.full((2, 64), 2.0))
    hooks.begin_step(owner, 2)
    assert hooks.drain(owner) == []


def test_the_state_names_the_hooks_module_that_made_it():
    # a reader (surgeon.run.vllm_runner) picks the module to drain with by this name, exactly
    spec = tiny_spec()
    a, b = hooks_for(spec, "dump"), hooks_for(spec, "dump")  # same spec, same slot count
    owner = torch.nn.Module()
    b.begin_step(owner, 2)
    b.capture_position(owner, 0, torch.ones(2, 64))
    assert owner._surgeon_hooks_state.owner == b.__name__ != a.__name__
    assert sys.modules[owner._surgeon_hooks_state.owner] is b


def test_more_tokens_than_max_tokens_fail_loudly_and_width_is_checked():
    hooks = hooks_for(tiny_spec(), "aux", max_tokens=4)
    stack = _Stack(hooks, 4, 64)
    with torch.no_grad(), pytest.raises(RuntimeError):
        stack(torch.randn(5, 64))
    hooks = hooks_for(tiny_spec(), "aux", max_tokens=4)
    with pytest.raises(ValueError, match="hidden_size"):
        hooks.capture_position(torch.nn.Linear(1, 1), 0, torch.randn(2, 32), None)


# -- a real transformers decoder stack, against the reference --------------------------------

IDS = [5, 17, 42, 99, 3, 250, 7, 128, 64, 11, 200, 31]


def _hf_forward(hooks, model, ids):
    """LlamaModel's forward reduced to its loop, with the hook calls a patch inserts."""
    m = model.model
    hooks.begin_step(m, ids.shape[-1])
    hidden_states = m.embed_tokens(ids)
    position_ids = torch.arange(ids.shape[-1])[None]
    position_embeddings = m.rotary_emb(hidden_states, position_ids=position_ids)
    hooks.capture_position(m, 0, hidden_states, None)
    for k, layer in enumerate(m.layers):
        hidden_states = layer(hidden_states, attention_mask=None, position_ids=position_ids,
                              position_embeddings=position_embeddings)
        hooks.capture_position(m, k + 1, hidden_states, None)
    hidden_states = m.norm(hidden_states)
    hooks.capture_final(m, hidden_states)
    return hidden_states


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from surgeon.run.tinymodels import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("hooks") / "llama", num_layers=4)


@pytest.mark.parametrize("mode", ["aux", "dump"])
@pytest.mark.slow  # torch.compile of a transformers model
def test_transformers_llama_compiled_fullgraph_captures_equal_eager_and_the_reference(tiny_llama, mode):
    from transformers import AutoModelForCausalLM

    from surgeon.verify.reference import capture_reference

    spec = tiny_spec()
    ref = capture_reference(tiny_llama, IDS)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    hooks = hooks_for(spec, mode)
    ids = torch.tensor([IDS])
    other = torch.tensor([[i * 7 % 256 for i in IDS]])
    with torch.no_grad():
        _hf_forward(hooks, model, ids)
        eager = [(n, p, t.clone()) for n, p, t in hooks.drain(model.model)]
        eager_aux = hooks.aux_hidden_states(model.model).clone() if mode == "aux" else None
        torch._dynamo.reset()
        explain = torch._dynamo.explain(_hf_forward)(hooks, model, other)
        assert explain.graph_break_count == 0, explain.break_reasons
        step = torch.compile(_hf_forward, fullgraph=True, backend="aot_eager")
        step(hooks, model, other)
        step(hooks, model, ids)
        compiled = hooks.drain(model.model)
    names = spec.fc_names if mode == "aux" else spec.dump_slots
    assert [n for n, _, _ in eager] == names
    for (name, point, a), (_, _, b) in zip(eager, compiled):
        assert close(b, a), f"{name}: compiled differs from eager"
        assert close(a, ref[point]), f"{name} ({point}): hooks differ from the transformers reference"
    if mode == "aux":
        assert torch.equal(eager_aux, torch.cat([ref["layer_out[2]"], ref["embed"], ref["layer_out[0]"]], 1)) or \
            close(eager_aux, torch.cat([ref["layer_out[2]"], ref["embed"], ref["layer_out[0]"]], 1))


# -- CUDA graphs ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["aux", "dump"])
def test_cuda_graph_capture_and_replay_on_new_inputs_match_eager(mode):
    spec = tiny_spec()
    torch.manual_seed(0)
    hooks = hooks_for(spec, mode, max_tokens=16)
    stack = _Stack(hooks, 4, 64).cuda().eval()
    static_x = torch.randn(16, 64, device="cuda")
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up allocates the buffers outside the capture
                stack(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = stack(static_x)
            static_aux = hooks.aux_hidden_states(stack) if mode == "aux" else None
        for trial in range(3):
            x = torch.randn(16, 64, device="cuda")
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            replayed = [(n, p, t.clone()) for n, p, t in hooks.drain(stack, 16)]
            replayed_aux = static_aux.clone() if mode == "aux" else None
            replayed_out = static_out.clone()
            stack(x)  # eager, same buffers
            eager = hooks.drain(stack, 16)
            assert torch.allclose(replayed_out, stack(x), atol=1e-5)
            for (name, _, a), (_, _, b) in zip(replayed, eager):
                assert torch.allclose(a, b, atol=1e-5), (trial, name)
            states, _ = _manual_states(stack, x)
            if mode == "aux":
                want = torch.cat([states[3], states[0], states[1]], 1)
                assert torch.allclose(replayed_aux, want, atol=1e-5)


def test_a_step_larger_than_the_buffers_raises_instead_of_spilling_into_the_next_slot():
    spec = load_spec(Path(__file__).resolve().parents[2] / "specs/demo-tiny-llama-eagle3.yaml")
    hooks = load_hooks_module(generate_hooks_module(spec, mode="dump", max_tokens=4), "_surgeon_hooks_overflow")
    owner = torch.nn.Module()
    hooks.begin_step(owner, 4)
    hooks.capture_position(owner, 2, torch.ones(4, 128))
    hooks.begin_step(owner, 5)
    with pytest.raises(RuntimeError, match="MAX_TOKENS"):
        hooks.capture_position(owner, 2, torch.ones(5, 128))


def test_aux_mode_refuses_to_hand_over_a_step_that_did_not_fill_every_fc_slot():
    spec = load_spec(Path(__file__).resolve().parents[2] / "specs/demo-tiny-llama-eagle3.yaml")
    hooks = load_hooks_module(generate_hooks_module(spec, mode="aux", max_tokens=8), "_surgeon_hooks_aux_partial")
    owner = torch.nn.Module()
    hooks.begin_step(owner, 3)
    for pos in (2, 4, 6):  # low, mid, high: layer_out[1], [3], [5]
        hooks.capture_position(owner, pos, torch.full((3, 128), float(pos)))
    out = hooks.aux_hidden_states(owner)
    assert out.shape == (3, 384) and out[:, 128:256].eq(4).all()  # fc order, column blocks
    hooks.begin_step(owner, 3)  # a step in which the last fc slot's layer ran elsewhere (a PP rank)
    hooks.capture_position(owner, 2, torch.ones(3, 128))
    hooks.capture_position(owner, 4, torch.ones(3, 128))
    with pytest.raises(RuntimeError, match="not every fc slot"):
        hooks.aux_hidden_states(owner)


def test_aux_handoff_inside_a_compiled_forward_has_zero_graph_breaks():
    """What `apply --mode aux` inserts runs inside the engine's forward, which vLLM compiles."""
    spec = load_spec(Path(__file__).resolve().parents[2] / "specs/demo-tiny-llama-eagle3.yaml")
    hooks = load_hooks_module(generate_hooks_module(spec, mode="aux", max_tokens=8), "_surgeon_hooks_aux_compiled")

    class Forward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(128, 128)

        def forward(self, x):
            hooks.begin_step(self, x.shape[0])
            h, aux_hidden_states = x, [x]
            for i in range(6):
                h = self.lin(h)
                hooks.capture_position(self, i + 1, h, x)
            if aux_hidden_states:
                aux_hidden_states = [hooks.aux_hidden_states(self)]
            return h, aux_hidden_states

    m = Forward().eval()
    with torch.no_grad():
        m(torch.randn(3, 128))
        torch._dynamo.reset()
        explain = torch._dynamo.explain(m)(torch.randn(3, 128))
        assert explain.graph_break_count == 0 and explain.graph_count == 1
        x = torch.randn(3, 128)
        h, [aux] = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
        states = [x]
        for _ in range(6):
            states.append(m.lin(states[-1]))
        assert torch.allclose(aux, torch.cat([states[k] + x for k in (2, 4, 6)], dim=1))


@pytest.mark.parametrize("mode", ["dump", "aux"])
def test_rows_written_short_of_rows_read_raise_instead_of_handing_out_stale_rows(mode):
    """A sequence-parallel rank holds 1/tp of the step's tokens after a layer: a capture there writes
    ``hs.shape[0]`` rows while drain (and the aux hand-off) read one row per token. The rest of the
    slot is an earlier step's: it must raise, never be returned."""
    spec = load_spec(Path(__file__).resolve().parents[2] / "specs/demo-tiny-llama-eagle3.yaml")
    hooks = load_hooks_module(generate_hooks_module(spec, mode=mode, max_tokens=8), f"_surgeon_hooks_rows_{mode}")
    positions = (2, 4, 6)  # the fc slots: layer_out[1], [3], [5] (also dump slots of this spec)
    owner = torch.nn.Module()
    hooks.begin_step(owner, 8)
    for pos in positions:
        hooks.capture_position(owner, pos, torch.ones(8, 128), torch.ones(8, 128))
    read = hooks.aux_hidden_states(owner) if mode == "aux" else hooks.drain(owner)
    assert len(read) > 0
    hooks.begin_step(owner, 8)
    for pos in positions:  # a shard: 8 tokens over tp=2, 4 rows each
        hooks.capture_position(owner, pos, torch.full((4, 128), 2.0), torch.zeros(4, 128))
    with pytest.raises(RuntimeError, match=r"wrote 4 rows but 8 are read back"):
        hooks.aux_hidden_states(owner) if mode == "aux" else hooks.drain(owner)
    if mode == "dump":  # reading back only what was written is fine (e.g. the true count under graph padding)
        assert all(t.shape[0] == 4 and t.eq(2).all() for _, _, t in hooks.drain(owner, 4))
    assert check_source(generate_hooks_module(spec, mode=mode, max_tokens=8)) == []  # still graph-safe
