"""The engines' own capture routes and plugin loaders, read from the real releases (issue 35).

The table below was filled by reading each release's files by eye: for each fact, the file it is
in and a name that must be on the cited line. vLLM 0.32.0 (installed) and 0.33.0 carry two
``extract_hidden_states`` proposers (``v1/spec_decode/`` for the default runner, asserting
``num_speculative_tokens == 1``; ``v1/worker/gpu/spec_decode/`` for the V2 runner, raising on it);
0.34.0 only the V2 one; 0.11.0 has no such method anywhere. The connector
(``example_hidden_states_connector.py``) refuses MLA verifiers in ``_find_cache_kv_group_id`` and
pins host memory in ``_submit_async_write``. SGLang 0.5.23 defines the flag in
``srt/arg_groups/fields/exec_.py`` and checks it in ``validation_hook.py``
(``_AUX_HIDDEN_STATE_CAPTURE_METHODS``, no draft, ``pp_size == 1``); 0.5.5 and 0.5.14 have only
``enable_return_hidden_states``. ``SGLANG_EXTERNAL_MODEL_PACKAGE`` is read in
``srt/models/registry.py`` from 0.5.14 on. Copies with a check removed or renamed prove the
answers are read, not assumed.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from surgeon.core.routefacts import SourceCite
from surgeon.engines.probes.native import clear_cache, read_route_facts, uses_mla
from tests.conftest import installed_engine, release_engine

pytestmark = pytest.mark.engine

CONNECTOR = "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
V1_PROPOSER = "v1/spec_decode/extract_hidden_states.py"
V2_PROPOSER = "v1/worker/gpu/spec_decode/extract_hidden_states.py"
PLUGINS = "plugins/__init__.py"
SGL_VALIDATE = "srt/arg_groups/validation_hook.py"
SGL_SETUP = "srt/model_executor/model_runner_components/attention_backend_setup.py"
SGL_IDS = "srt/model_executor/model_runner_components/spec_aux_hidden_state.py"
SGL_REGISTRY = "srt/models/registry.py"


def root_of(label: str) -> Path:
    if label.endswith("installed"):
        return installed_engine(label.split("-")[0]).root
    dist, version = label.rsplit("-", 1)
    return release_engine(dist, version)


# label -> (engine, native available, {fact: (file, name on the cited line)}, plugin (file, name) or None)
VLLM_COMMON = {
    "defined": ("config/speculative.py", '"extract_hidden_states"'),
    "mla": (CONNECTOR, "MLA verifiers are unsupported"),
    "pin_memory": (CONNECTOR, "pin_memory=True"),
}
TABLE = {
    "vllm-installed": ("vllm", True, {**VLLM_COMMON, "ids_read": (V1_PROPOSER, "eagle_aux_hidden_state_layer_ids"),
                                      "spec_tokens": (V1_PROPOSER, "num_speculative_tokens == 1")},
                       (PLUGINS, '"vllm.general_plugins"')),
    "vllm-0.33.0": ("vllm", True, {**VLLM_COMMON, "ids_read": (V1_PROPOSER, "eagle_aux_hidden_state_layer_ids"),
                                   "spec_tokens": (V1_PROPOSER, "num_speculative_tokens == 1")},
                    (PLUGINS, '"vllm.general_plugins"')),
    "vllm-0.34.0": ("vllm", True, {**VLLM_COMMON, "ids_read": (V2_PROPOSER, '"eagle_aux_hidden_state_layer_ids"'),
                                   "spec_tokens": (V2_PROPOSER, "requires num_speculative_tokens to be 1"),
                                   "sampling": (V2_PROPOSER, "draft_sample_method='greedy'")},
                    (PLUGINS, '"vllm.general_plugins"')),
    "vllm-0.11.0": ("vllm", False, {}, (PLUGINS, "'vllm.general_plugins'")),
    "sglang-installed": ("sglang", True, {
        "defined": ("srt/arg_groups/fields/exec_.py", "enable_return_aux_hidden_states: A["),
        "ids_read": (SGL_IDS, "features.return_aux_hidden_state_layer_ids"),
        "pp": (SGL_VALIDATE, "only supports pp_size == 1"),
        "draft": (SGL_VALIDATE, "--speculative-draft-model-path"),
        "algorithm": (SGL_VALIDATE, "needs --speculative-algorithm"),
    }, (SGL_REGISTRY, "envs.SGLANG_EXTERNAL_MODEL_PACKAGE.get()")),
    "sglang-0.5.14": ("sglang", False, {}, (SGL_REGISTRY, "envs.SGLANG_EXTERNAL_MODEL_PACKAGE.get()")),
    "sglang-0.5.5": ("sglang", False, {}, None),
}


def cited(facts, fact: str) -> SourceCite:
    n = facts.native
    if fact in ("defined", "ids_read"):
        cite = getattr(n, fact)
        assert cite is not None, fact
        return cite
    found = [c.cite for c in (*n.refusals, *n.hazards) if c.code == fact and c.cite is not None]
    assert found, f"no {fact} condition read: {[c.code for c in n.refusals + n.hazards]}"
    return found[0]


def assert_verbatim(root: Path, cite: SourceCite) -> None:
    """The cite's text is the file's own line, stripped."""
    line = (root / cite.path).read_text(encoding="utf-8", errors="replace").splitlines()[cite.line - 1]
    assert line.strip() == cite.text, cite


@pytest.mark.parametrize("label", sorted(TABLE))
def test_each_release_reads_as_the_hand_read_table(label: str) -> None:
    engine, available, facts_table, plugin = TABLE[label]
    root = root_of(label)
    facts = read_route_facts(engine, root)
    assert facts.native.available is available, facts.native.reason
    if not available:
        assert facts.native.reason.startswith("not found in "), facts.native.reason
        assert "files" in facts.native.reason and facts.native.defined is None and not facts.native.refusals
    for fact, (path, name) in facts_table.items():
        cite = cited(facts, fact)
        assert cite.path == path and name in cite.text, (fact, cite)
        assert_verbatim(root, cite)
    every = [c.cite for c in (*facts.native.refusals, *facts.native.hazards) if c.cite is not None]
    every += [s[2] for s in facts.native.setters] + list(facts.native.id_reads)
    for cite in every:
        assert_verbatim(root, cite)
    assert facts.plugin.available is (plugin is not None), facts.plugin.reason
    if plugin is not None:
        assert facts.plugin.cite is not None and facts.plugin.cite.path == plugin[0] and plugin[1] in facts.plugin.cite.text
        assert_verbatim(root, facts.plugin.cite)


def test_vllm_route_names_its_switch_threads_and_what_it_writes() -> None:
    n = read_route_facts("vllm", root_of("vllm-0.34.0")).native
    assert n.switch == ("extract_hidden_states", "ExampleHiddenStatesConnector")
    assert n.algorithms == () and n.setters == ()
    by_code = {h.code: h for h in n.hazards}
    assert by_code["prefix_caching"].thread == "vllm#44485" and not by_code["prefix_caching"].read
    assert by_code["hybrid"].thread == "vllm#51328" and not by_code["hybrid"].read
    assert by_code["pp"].undecided
    writes = " ".join(n.writes)
    assert ".safetensors" in writes and "'hidden_states'" in writes and "'token_ids'" in writes
    assert "shared_storage_path" in writes and "[T, n, H]" in writes
    assert n.final_state is not None and n.final_state.text.startswith("cannot")
    assert n.final_state.cite is not None and "torch.stack(aux_hidden_states" in n.final_state.cite.text
    # 0.32/0.33: both proposers are read, the default runner's first
    old = read_route_facts("vllm", root_of("vllm-0.33.0")).native
    assert [c.path for c in old.id_reads] == [V1_PROPOSER, V2_PROPOSER]


def test_vllm_plugin_errors_are_read_import_swallowed_function_not() -> None:
    for label in ("vllm-0.11.0", "vllm-0.34.0"):
        p = read_route_facts("vllm", root_of(label)).plugin
        assert p.kind == "entry_points" and p.name == "vllm.general_plugins"
        assert p.errors is not None and "logged and skipped" in p.errors and "stops the engine start" in p.errors
        texts = [c.text for c in p.error_cites]
        assert texts == ["except Exception:", "func()"], texts


def test_sglang_route_algorithms_setters_and_bounds() -> None:
    n = read_route_facts("sglang", root_of("sglang-installed")).native
    assert n.switch == ("--enable-return-aux-hidden-states", "--speculative-algorithm",
                        "--return-aux-hidden-state-layer-ids")
    assert n.algorithms == ("EAGLE3", "DFLASH", "DSPARK")
    assert [s for s, _ in n.setters_for("EAGLE3")] == ["set_eagle3_layers_to_capture"]
    assert [s for s, _ in n.setters_for("DFLASH")] == ["set_dflash_layers_to_capture"]
    assert [s for s, _ in n.setters_for("dspark")] == ["set_dspark_layers_to_capture", "set_dflash_layers_to_capture"]
    assert all(c.path == SGL_SETUP for _, _, c in n.setters)
    # the check that --return-aux-hidden-state-layer-ids needs the flag is not a refusal of the route
    assert not any("requires --enable-return-aux-hidden-states" in r.text for r in n.refusals)
    assert n.final_state is not None and n.final_state.cite is not None and ">= num_layers" in n.final_state.cite.text
    p = read_route_facts("sglang", root_of("sglang-installed")).plugin
    assert p.errors is not None and "strict" in p.errors


def test_releases_without_the_route_say_what_else_they_have() -> None:
    for label in ("sglang-0.5.5", "sglang-0.5.14"):
        reason = read_route_facts("sglang", root_of(label)).native.reason
        assert "only enable_return_hidden_states" in reason and "srt/server_args.py:" in reason, reason
    reason = read_route_facts("vllm", root_of("vllm-0.11.0")).native.reason
    assert "nor anywhere in the package" in reason, reason


@pytest.mark.parametrize("label", ["vllm-installed", "vllm-0.11.0", "vllm-0.33.0", "vllm-0.34.0"])
def test_vllm_mla_is_read_from_the_model_file(label: str) -> None:
    root = root_of(label)
    mla = uses_mla("vllm", root, "model_executor/models/deepseek_v2.py", "DeepseekV3ForCausalLM")
    assert mla is not None and mla.code == "mla" and mla.text.startswith("when ") and "use_mla" in mla.text
    assert mla.cite is not None and "DeepseekV2MLAAttention" in mla.cite.text
    assert_verbatim(root, mla.cite)
    assert uses_mla("vllm", root, "model_executor/models/llama.py", "LlamaForCausalLM") is None
    assert uses_mla("vllm", root, "model_executor/models/qwen3.py", "Qwen3ForCausalLM") is None
    missing = uses_mla("vllm", root, "model_executor/models/deepseek_v2.py", "NoSuchForCausalLM")
    assert missing is not None and missing.undecided


@pytest.mark.parametrize("label", ["sglang-installed", "sglang-0.5.5", "sglang-0.5.14"])
def test_sglang_mla_is_always_on_deepseek(label: str) -> None:
    root = root_of(label)
    mla = uses_mla("sglang", root, "srt/models/deepseek_v2.py", "DeepseekV3ForCausalLM")
    assert mla is not None and mla.text == "always" and mla.cite is not None and "DeepseekV2AttentionMLA(" in mla.cite.text
    assert uses_mla("sglang", root, "srt/models/llama.py", "LlamaForCausalLM") is None


def test_kimi_k25_builds_its_inner_model_by_name_on_vllm_undecided_there() -> None:
    mla = uses_mla("vllm", root_of("vllm-0.34.0"), "model_executor/models/kimi_k25.py", "KimiK25ForConditionalGeneration")
    assert mla is not None and mla.undecided and "init_vllm_registered_model" in (mla.cite.text if mla.cite else "")


# -- copies with a check changed ------------------------------------------------------------------
VLLM_PARTS = ("config", "v1", "distributed/kv_transfer", "plugins")


@pytest.fixture
def vllm_copy(tmp_path: Path) -> Path:
    src = root_of("vllm-0.34.0")
    dest = tmp_path / "vllm"
    for part in VLLM_PARTS:
        shutil.copytree(src / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "model_executor/models").mkdir(parents=True)
    shutil.copy(src / "model_executor/models/llama.py", dest / "model_executor/models/llama.py")
    clear_cache()
    return dest


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))
    clear_cache()


def test_a_copy_reads_like_its_release_then_each_edit_changes_the_answer(vllm_copy: Path) -> None:
    n = read_route_facts("vllm", vllm_copy).native
    assert n.available and n.refusal("mla") and n.refusal("spec_tokens") and n.hazard("pin_memory")
    edit(vllm_copy / CONNECTOR, "(MLA verifiers are unsupported)", "(one group only)")
    assert not read_route_facts("vllm", vllm_copy).native.refusal("mla")
    edit(vllm_copy / CONNECTOR, "pin_memory=True", "pin_memory=False")
    assert not read_route_facts("vllm", vllm_copy).native.hazard("pin_memory")
    edit(vllm_copy / V2_PROPOSER, "if self.num_speculative_steps != 1:\n            raise ValueError(\n"
         '                "extract_hidden_states requires num_speculative_tokens to be 1"\n            )\n', "")
    assert not read_route_facts("vllm", vllm_copy).native.refusal("spec_tokens")
    edit(vllm_copy / PLUGINS, "        func()\n", "        try:\n            func()\n        except Exception:\n"
         "            pass\n")
    assert "is caught and logged" in (read_route_facts("vllm", vllm_copy).plugin.errors or "")
    edit(vllm_copy / "config/speculative.py", '"eagle", "eagle3", "extract_hidden_states",', '"eagle", "eagle3",')
    n = read_route_facts("vllm", vllm_copy).native
    assert not n.available and n.reason.startswith("not found in vllm"), n.reason


def test_a_renamed_proposer_read_or_an_unreadable_connector_is_not_available(vllm_copy: Path) -> None:
    edit(vllm_copy / V2_PROPOSER, '"eagle_aux_hidden_state_layer_ids",', '"aux_layer_ids",')
    n = read_route_facts("vllm", vllm_copy).native
    assert not n.available and "no proposer reads eagle_aux_hidden_state_layer_ids" in n.reason
    (vllm_copy / CONNECTOR).unlink()
    os.mkfifo(vllm_copy / CONNECTOR)  # refused at once by the safe read, never waited on
    clear_cache()
    start = time.monotonic()
    n = read_route_facts("vllm", vllm_copy).native
    assert not n.available and time.monotonic() - start < 10


@pytest.fixture
def sglang_copy(tmp_path: Path) -> Path:
    src = root_of("sglang-installed")
    dest = tmp_path / "sglang"
    for part in ("srt/arg_groups", "srt/model_executor", "srt/layers/aux_hidden_states.py", "srt/models/registry.py",
                 "srt/models/llama.py"):
        if (src / part).is_dir():
            shutil.copytree(src / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / part, dest / part)
    clear_cache()
    return dest


def test_sglang_copy_edits_change_algorithms_and_refusals(sglang_copy: Path) -> None:
    n = read_route_facts("sglang", sglang_copy).native
    assert n.available and n.algorithms == ("EAGLE3", "DFLASH", "DSPARK") and n.refusal("pp")
    edit(sglang_copy / SGL_VALIDATE, '("EAGLE3", "DFLASH", "DSPARK")', '("EAGLE3", "DFLASH")')
    pp = sglang_copy / SGL_VALIDATE
    start = pp.read_text().index("    if cfg.pp_size != 1:")
    end = pp.read_text().index("    layer_ids = cfg.return_aux_hidden_state_layer_ids")
    edit(pp, pp.read_text()[start:end], "")  # the pp check, removed
    n = read_route_facts("sglang", sglang_copy).native
    assert n.algorithms == ("EAGLE3", "DFLASH") and not n.setters_for("DSPARK") and not n.refusal("pp")
    edit(sglang_copy / "srt/arg_groups/fields/exec_.py", "enable_return_aux_hidden_states: A[", "enable_aux_capture: A[")
    assert not read_route_facts("sglang", sglang_copy).native.available


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_garbage_root_is_unavailable_not_a_traceback(engine: str, tmp_path: Path) -> None:
    (tmp_path / "junk.py").write_text("x = 1\n")
    for root in (tmp_path, tmp_path / "missing"):
        facts = read_route_facts(engine, root)
        assert not facts.native.available and not facts.plugin.available
        assert facts.native.reason and facts.plugin.reason
    assert uses_mla(engine, tmp_path, "x.py", "X") is not None


def test_one_release_reads_well_under_a_second() -> None:
    clear_cache()
    start = time.perf_counter()
    read_route_facts("vllm", root_of("vllm-0.34.0"))
    assert time.perf_counter() - start < 2.0  # measured about 0.25 s here; generous for a shared machine
