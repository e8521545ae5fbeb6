"""Token-splitting paths: vLLM's deepseek_v2.py with sequence-parallel MoE leaves each rank with its
shard of the residual stream after a layer (the layer reduce-scatters) and gathers it later. A capture
right after the layer call would write one rank's rows. The planner reads the method's own shard test
and gather from the real file and captures the gathered stream, or refuses naming the line."""

from __future__ import annotations

import ast

import pytest
import torch

from surgeon.capture.hooks import generate_hooks_module, load_hooks_module
from surgeon.core.spec import load_spec
from surgeon.patch.recipes import PatchApplicationError
from surgeon.patch.rewriter import rewrite
from tests.conftest import installed_engine, release_engine

pytestmark = pytest.mark.engine

REL = "model_executor/models/deepseek_v2.py"
CLS = "DeepseekV2Model"


def _capture_call(new: bytes) -> ast.Call:
    tree = ast.parse(new)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "capture_position" and len(n.args) == 4
             and not isinstance(n.args[1], ast.Constant)]  # the in-loop call (idx + 1 or a counter), not embed
    assert len(calls) == 1
    return calls[0]


@pytest.mark.parametrize("where", ["installed", "0.33.0"])
def test_sequence_parallel_deepseek_captures_the_gathered_stream(where):
    root = installed_engine("vllm").root if where == "installed" else release_engine("vllm", where)
    src = (root / REL).read_bytes()
    lines = src.decode().splitlines()
    res = rewrite(src, relpath=REL, class_name=CLS, positions={3, 31}, capture_final=True)
    gather = [a for a in res.anchors if ":gather@" in a]
    assert len(gather) == 1
    line = int(gather[0].rsplit("@", 1)[1])
    assert "tensor_model_parallel_all_gather(" in lines[line - 1]  # the engine's own gather, file:line
    call = _capture_call(res.new_bytes)
    hs, residual = (ast.unparse(a) for a in call.args[2:])
    for name, text in (("hidden_states", hs), ("residual", residual)):
        assert text == (f"{name} if {name} is None or {name}.shape[0] == positions.shape[0] "
                        f"else tensor_model_parallel_all_gather({name}, 0)[:positions.shape[0]]")
    # the collective runs only where a capture is asked for, and the same way on every rank
    new_lines = res.new_bytes.decode().splitlines()
    assert new_lines[call.lineno - 2].strip() == "if idx + 1 in {3, 31}:"


def test_the_gathered_capture_fills_every_row_and_a_shard_would_raise():
    """Run the planned argument expressions (from the real file) with CPU tensors: two ranks' shards
    gathered give one row per token, and the hooks take them; the unwrapped shard raises at drain."""
    src = (installed_engine("vllm").root / REL).read_bytes()
    call = _capture_call(rewrite(src, relpath=REL, class_name=CLS, positions={3}, capture_final=False).new_bytes)
    positions = torch.arange(7)
    full_h, full_r = torch.randn(8, 64), torch.randn(8, 64)  # 7 tokens padded to 8 over tp=2

    def all_gather(x, dim):
        other = (full_h if x.data_ptr() == full_h[:4].data_ptr() else full_r)[4:]
        return torch.cat([x, other], dim)

    env = {"positions": positions, "hidden_states": full_h[:4], "residual": full_r[:4],
           "tensor_model_parallel_all_gather": all_gather}
    h = eval(compile(ast.Expression(call.args[2]), "<arg>", "eval"), env)
    r = eval(compile(ast.Expression(call.args[3]), "<arg>", "eval"), env)
    assert torch.equal(h, full_h[:7]) and torch.equal(r, full_r[:7])
    spec = load_spec("s.yaml", text="spec: 1\nname: sp\ntarget: {architecture: DeepseekV3ForCausalLM, num_layers: 4, "
                     "hidden_size: 64}\ncaptures: {a: 'layer_out[2]'}\ndumps: {layout: specforge, slots: [a]}\n")
    hooks = load_hooks_module(generate_hooks_module(spec, mode="dump", max_tokens=16), "_surgeon_hooks_sp_test")
    owner = torch.nn.Module()
    hooks.begin_step(owner, 7)
    hooks.capture_position(owner, 3, h, r)
    [(_, _, got)] = hooks.drain(owner)
    assert torch.equal(got, full_h[:7] + full_r[:7])
    hooks.begin_step(owner, 7)
    hooks.capture_position(owner, 3, full_h[:4], full_r[:4])  # what the unguarded patch wrote: a shard
    with pytest.raises(RuntimeError, match="wrote 4 rows but 7"):
        hooks.drain(owner)


def test_a_split_whose_gather_cannot_be_read_is_refused_with_the_line():
    src = (installed_engine("vllm").root / REL).read_bytes().decode()
    old = "combined_states = combined_states[: positions.shape[0]]"
    assert old in src
    edited = src.replace(old, "combined_states = trim(combined_states)", 1)
    with pytest.raises(PatchApplicationError) as e:
        rewrite(edited.encode(), relpath=REL, class_name=CLS, positions={3}, capture_final=False)
    msg = str(e.value)
    assert "split across ranks" in msg and "hidden_states.shape[0] != positions.shape[0]" in msg
    line = int(msg.split(":split@", 1)[1].split()[0].rstrip(":"))
    assert "hidden_states.shape[0] != positions.shape[0]" in edited.splitlines()[line]  # the `if (` line + 1


def test_a_release_without_the_split_keeps_the_plain_capture():
    src = (release_engine("vllm", "0.11.0") / REL).read_bytes()
    res = rewrite(src, relpath=REL, class_name=CLS, positions={3}, capture_final=False)
    assert not any(":gather@" in a for a in res.anchors)
    assert [ast.unparse(a) for a in _capture_call(res.new_bytes).args[2:]] == ["hidden_states", "residual"]
