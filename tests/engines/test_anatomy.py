"""The decoder-loop anatomy (surgeon.engines.source.anatomy) on small libcst snippets and on the real
engine model files installed in the venv (read, never imported)."""

from __future__ import annotations

import ast
import textwrap

import libcst as cst
import pytest

from surgeon.engines.source.anatomy import (
    COUNTER,
    LAYER_LIST_CALLS,
    AnatomyRefusal,
    ClassAnatomy,
    ModuleIndex,
    code,
    hands_layers_on,
    index_offset,
    layer_list_call_kind,
    layer_loops,
    layers_loops,
    loops_over_ast,
)
from surgeon.engines.source.locate import ProbeError, locate_engine


def _anatomy(source: str | bytes, class_name: str = "M", method: str = "forward") -> ClassAnatomy:
    src = textwrap.dedent(source).encode() if isinstance(source, str) else source
    idx = ModuleIndex(cst.parse_module(src), src)
    cls = next(c for c in idx.module.body if isinstance(c, cst.ClassDef) and c.name.value == class_name)
    fn = next(f for f in cls.body.body if isinstance(f, cst.FunctionDef) and f.name.value == method)
    idx.index_method(cls, fn)
    return ClassAnatomy(idx, cls, fn, layers_loops(idx, fn, "layers"), "layers")


def _forward(loop: str, params: str = "self, positions, hidden_states", tail: str = "") -> str:
    body = textwrap.indent(textwrap.dedent(loop).strip("\n"), " " * 8)
    return f"import torch\n\n\nclass M:\n    def forward({params}):\n        residual = None\n{body}\n{tail}"


# -- how the loop variable maps to the global layer index ------------------------------------
@pytest.mark.parametrize("loop, index, start, counter", [
    (("for i in range(self.start_layer, self.end_layer):\n"
     "    hidden_states, residual = self.layers[i](positions, hidden_states, residual)"),
     "i", "self.start_layer", False),
    ("for i in range(len(self.layers)):\n    layer = self.layers[i]\n    hidden_states = layer(hidden_states)",
     "i", "0", False),
    (("for i, layer in enumerate(self.layers[self.start_layer:self.end_layer]):\n"
     "    hidden_states = layer(hidden_states)"), "self.start_layer + i", "self.start_layer", False),
    ("for i, layer in enumerate(self.layers[a:b], start=a):\n    hidden_states = layer(hidden_states)",
     "i", "a", False),
    (("for idx, layer in islice(enumerate(self.layers), self.start_layer, self.end_layer):\n"
     "    hidden_states = layer.forward(hidden_states)"), "idx", "self.start_layer", False),
    ("for layer in self.layers[self.start_layer:self.end_layer]:\n    hidden_states = layer(hidden_states)",
     COUNTER, "self.start_layer", True),
    ("for layer in islice(self.layers, self.start_layer, self.end_layer):\n    hidden_states = layer(hidden_states)",
     COUNTER, "self.start_layer", True),
])
def test_loop_index_maps_to_the_global_layer_index(loop, index, start, counter):
    a = _anatomy(_forward(loop))
    assert len(a.loops) == 1
    lp = a.loop
    assert lp.problem is None, lp.problem
    assert code(lp.index) == index and code(lp.start) == start and lp.counter is counter
    assert lp.call_stmt is not None and "hidden_states" in code(lp.call_stmt)
    assert a.idx.line(lp.node) == 7  # the file's line, from a per-method index


@pytest.mark.parametrize("loop, problem", [
    ("for i, layer in enumerate(self.layers[a:b], start=c):\n    hidden_states = layer(hidden_states)",
     "differs from the slice start"),
    (("for i in range(self.start_layer, self.end_layer):\n    i = i + 1\n"
     "    hidden_states = self.layers[i](hidden_states)"), "reassigns the layer index"),
    ("for i in range(3):\n    if i == 1:\n        continue\n    hidden_states = self.layers[i](hidden_states)",
     "can end before the end-of-iteration capture"),
    ("for i in range(3):\n    out = self.layers[i](hidden_states)", "not assigned to `hidden_states`"),
    ("for i in range(3):\n    hidden_states = self.layers[i](self.layers[i](hidden_states))",
     "2 decoder-layer calls"),
    ("for layer in list(self.layers):\n    hidden_states = layer(hidden_states)", "has no layer index variable"),
])
def test_loops_the_anatomy_cannot_capture_say_why(loop, problem):
    a = _anatomy(_forward(loop))
    assert len(a.loops) == 1 and a.loop.problem is not None and problem in a.loop.problem, a.loop.problem


def test_one_call_per_branch_is_one_layer_call():
    a = _anatomy(_forward("for i in range(3):\n    if i % 2:\n        hidden_states = self.layers[i](hidden_states)\n"
                          "    else:\n        hidden_states = self.layers[i](hidden_states, x=1)"))
    assert a.loop.problem is None


def test_loops_not_over_the_layers_are_no_decoder_loop():
    a = _anatomy(_forward("for i in range(3):\n    hidden_states = self.mlps[i](hidden_states)"))
    assert a.loops == []


def test_index_offset_reads_index_plus_k():
    def off(text: str):
        return index_offset(cst.parse_expression(text), "i")
    assert [off("i"), off("i + 1"), off("1 + i"), off("i - 1"), off("i - self.start_layer + 1"),
            off("self.start_layer + i"), off("j + 1"), off("2 * i")] == [0, 1, 1, -1, 1, 0, None, None]


# -- the shared bypass table -----------------------------------------------------------------
def test_one_table_of_calls_that_only_look_at_the_layer_list():
    # the union of the lists the probe (16 names) and the rewriter (4) kept apart, each justified
    assert set(LAYER_LIST_CALLS) >= {"len", "isinstance", "getattr", "hasattr", "enumerate", "islice", "zip",
                                     "range", "list", "iter", "tuple", "reversed", "print", "id", "type", "setattr"}
    assert all(kind in ("inspects", "iterates") and why for kind, why in LAYER_LIST_CALLS.values())
    kind = lambda t: layer_list_call_kind(cst.parse_expression(t))
    assert (kind("len"), kind("itertools.islice"), kind("self.run_layers"), kind("f()")) == \
        ("inspects", "iterates", None, None)


@pytest.mark.parametrize("func, probe, rewriter", [
    ("len", False, False),  # only looks at the list: never a bypass
    ("enumerate", False, True),  # feeds a second loop: the probe reads that loop, the rewriter cannot
    ("zip", False, True),
    ("run_stages", True, True),  # handed to another call: it may run layers
    ("self.model_forward_stages", True, True),
])
def test_the_probe_follows_iterables_to_their_loop_the_rewriter_counts_the_call(func, probe, rewriter):
    f = cst.parse_expression(func)
    assert hands_layers_on(f, follow_second_loops=True) is probe
    assert hands_layers_on(f, follow_second_loops=False) is rewriter


def test_the_probe_reads_any_loop_whose_body_runs_a_layer():
    src = _forward("for cache, layer in zip(caches, self.layers):\n    hidden_states = layer(hidden_states, cache)\n"
                   "for k in order:\n    hidden_states = self.layers[k + 1](hidden_states)\n"
                   "for i in ids:\n    self.aux.append(i)")
    a = _anatomy(src)
    loops = layer_loops(a.fn, "layers")  # the loop over the ids runs no layer
    assert [(ll.index_var, ll.elem_var, code(ll.call.func)) for ll in loops] == [
        ("cache", "layer", "layer"), ("k", None, "self.layers[k + 1]")]
    assert a.loops == []  # neither maps its variable to the global index: the rewriter has no decoder loop


def test_bypasses_outside_the_loop_with_their_bounds():
    a = _anatomy(_forward(
        "for i in range(self.start_layer, end):\n    hidden_states = self.layers[i](hidden_states)",
        tail="        n = len(self.layers)\n"
             "        hidden_states = run_stages(self.layers[end:self.end_layer], hidden_states)\n"
             "        last = self.layers[0]\n        hidden_states = last(hidden_states)\n"))
    found = [(b.what.split()[0], code(b.first), code(b.last), b.line) for b in a.bypasses()]
    assert found == [("runs", "end", "self.end_layer", 10), ("calls", "0", "1", 12)]
    assert a.bypasses() is a.bypasses()  # computed once per class


def test_a_one_line_if_is_guarded_before_the_if():
    a = _anatomy(_forward("for i in range(3):\n    hidden_states = self.layers[i](hidden_states)",
                          tail="        if x: hidden_states = self.layers[0](hidden_states)\n"))
    [b] = a.bypasses()
    assert isinstance(b.stmt, cst.If) and (code(b.first), code(b.last)) == ("0", "1")


# -- where the residual stream is readable ---------------------------------------------------
def test_local_residual_bound_before_the_loop_is_read_with_hidden_states():
    a = _anatomy(_forward("for i in range(3):\n    hidden_states, residual = self.layers[i](hidden_states, residual)"))
    r = a.reader()
    assert code(r.residual) == "residual" and r.before_loop and not r.costly
    assert [code(x) for x in r.args(before_loop=True)] == ["hidden_states", "residual"]


def test_sglang_residual_batch_snapshot_reads_the_stream():
    src = ("from sglang.srt.layers.layer_boundary.residual import batch as residual_batch\n\n\n"
           + _forward("for i in range(3):\n    hidden_states = self.layers[i](positions, hidden_states, forward_batch)\n"
                      "residual_batch.finish(forward_batch)",
                      params="self, positions, hidden_states, forward_batch").split("\n", 3)[3]
           .replace("        residual = None\n", ""))
    r = _anatomy(src).reader()
    assert r.alias == "residual_batch" and r.costly
    assert [code(x) for x in r.args(before_loop=False)] == ["residual_batch.snapshot(hidden_states, forward_batch)", "None"]


def test_a_residual_that_is_not_a_local_is_refused():
    src = _forward("for i in range(3):\n    hidden_states = self.layers[i](hidden_states, self.residual_cache)") \
        .replace("        residual = None\n", "        my_residual_buf = None\n")
    a = _anatomy(src)
    for _ in range(2):  # the refusal is kept and raised again
        with pytest.raises(AnatomyRefusal, match="my_residual_buf"):
            a.reader()


def test_final_norm_after_the_loop():
    a = _anatomy(_forward("for i in range(3):\n    hidden_states = self.layers[i](hidden_states)",
                          tail="        hidden_states, _ = self.norm(hidden_states, residual)\n        return hidden_states\n"))
    [(stmt, name)] = a.final_norm(("norm",))
    assert name == "hidden_states" and a.idx.line(stmt) == 9


# -- the stdlib prefilter is a superset ------------------------------------------------------
@pytest.mark.parametrize("loop", [
    "for i in range(3):\n    hidden_states = self.layers[i](hidden_states)",
    "for layer in self.layers[1:]:\n    hidden_states = layer(hidden_states)",
    "for i, layer in enumerate(self.layers):\n    hidden_states = layer(hidden_states)",
])
def test_ast_prefilter_sees_every_loop_the_anatomy_reads(loop):
    src = _forward(loop)
    assert _anatomy(src).loops
    fn = ast.parse(src).body[1].body[0]
    assert loops_over_ast(fn, "layers") and not loops_over_ast(fn, "blocks")


# -- real engine files -------------------------------------------------------------------------
def _engine_file(engine: str, rel: str) -> bytes:
    try:
        return (locate_engine(engine).root / rel).read_bytes()
    except (ProbeError, OSError):
        pytest.fail(f"the {engine} engine installed in the venv has no {rel}")


def test_sglang_llama_model_loop():
    a = _anatomy(_engine_file("sglang", "srt/models/llama.py"), "LlamaModel")
    assert len(a.loops) == 1 and a.loop.problem is None
    assert code(a.loop.index) == "i" and code(a.loop.start) == "self.start_layer"
    assert a.bypasses() == []


def test_sglang_deepseek_two_batch_overlap_is_a_bypass_with_bounds():
    a = _anatomy(_engine_file("sglang", "srt/models/deepseek_v2.py"), "DeepseekV2Model")
    assert len(a.loops) == 1 and a.loop.problem is None
    [b] = a.bypasses()
    assert "model_forward_stages" in b.text or "self.layers[" in b.text
    assert b.first is not None and "end_layer" in code(b.last)


@pytest.mark.parametrize("engine, rel, cls, index_var, callee", [
    ("sglang", "srt/models/llama.py", "LlamaModel", "i", "self.layers[i]"),
    ("sglang", "srt/models/deepseek_v2.py", "DeepseekV2Model", "i", "layer"),
    ("vllm", "model_executor/models/llama.py", "LlamaModel", "idx", "layer"),
])
def test_the_probe_and_the_rewriter_read_the_same_decoder_loop(engine, rel, cls, index_var, callee):
    a = _anatomy(_engine_file(engine, rel), cls)
    [ll] = layer_loops(a.fn, "layers")
    assert ll.node is a.loop.node  # one loop, found once, for both readers
    assert ll.index_var == index_var and code(ll.call.func) == callee
    assert a.idx.enclosing_stmt(ll.call) is a.loop.call_stmt


def test_vllm_llama_model_loop_is_index_less_with_a_counter():
    a = _anatomy(_engine_file("vllm", "model_executor/models/llama.py"), "LlamaModel")
    assert len(a.loops) == 1 and a.loop.problem is None
    assert a.loop.counter or code(a.loop.index) in ("idx", "i")
    assert "start_layer" in code(a.loop.start)
