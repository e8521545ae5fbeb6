"""Norm flags followed from the read to the use: on the real engine draft files (the installed
SGLang 0.5.23 and vLLM 0.32, and fetched releases), per flag one of used (with the use site), read
but unused, not read or unverified; and before/after copies of an engine file whose use is deleted
(the read kept), which check-draft must call read but unused, an error when the draft needs it."""

import json
import shutil

import jsonschema
import pytest

from surgeon.commands.outputs import output_schema
from surgeon.core.spec import load_spec
from surgeon.engines.facts.draft_norms import read_norms
from surgeon.engines.source.locate import locate_engine
from surgeon.wiring.draft import check_draft
from surgeon.wiring.norms import norm_lines
from tests.conftest import cli_run, installed_engine, norms_spec, release_engine, vllm_models_copy

FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
IDS = {"eagle_aux_hidden_state_layer_ids": [2, 4, 6], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}


def spec(tmp_path, norms=""):
    return load_spec(norms_spec(tmp_path, norms))


def states(loc, arch):
    """flag -> (state, read file:line, use file:line) for the draft class ``arch``."""
    reading = read_norms(loc, {"architectures": [arch]})
    out = {}
    for flag in FLAGS:
        state, read = reading.state(flag)
        used = read.use.at if read is not None and read.use is not None and state == "used" else None
        out[flag] = (state, read.where if read is not None else None, used)
    return out


def line_at(root, where):
    """The text of the engine file line ``where`` (package-relative path:line)."""
    path, _, line = where.rpartition(":")
    return (root.parent / path).read_text().splitlines()[int(line) - 1].strip()


V = "vllm/model_executor/models/"
# vLLM 0.33.0, read by hand: the read, and where its value changes the forward
VLLM_033 = {
    "LlamaForCausalLMEagle3": {
        "norm_before_residual": ("used", V + "llama_eagle3.py:101", V + "llama_eagle3.py:134"),
        "norm_before_fc": ("used", V + "llama_eagle3.py:185", V + "llama_eagle3.py:405"),
        "fc_norm": ("used", V + "llama_eagle3.py:231", V + "llama_eagle3.py:411"),
        "norm_output": ("used", V + "llama_eagle3.py:252", V + "llama_eagle3.py:286")},
    "Eagle3DeepseekV2ForCausalLM": {
        "norm_before_residual": ("used", V + "deepseek_eagle3.py:101", V + "deepseek_eagle3.py:130"),
        "norm_before_fc": ("not_read", None, None),
        "fc_norm": ("used", V + "deepseek_eagle3.py:211", V + "deepseek_eagle3.py:362"),
        "norm_output": ("used", V + "deepseek_eagle3.py:222", V + "deepseek_eagle3.py:254")},
}


@pytest.mark.parametrize("arch", sorted(VLLM_033))
def test_vllm_033_each_flag_read_and_used_at(arch):
    root = release_engine("vllm", "0.33.0")
    got = states(locate_engine("vllm", root), arch)
    assert got == VLLM_033[arch]
    assert line_at(root, V + "llama_eagle3.py:134").startswith("hidden_states, residual = self._residual_norm(")
    assert line_at(root, V + "llama_eagle3.py:405") == "if self.model.norm_before_fc:"
    assert line_at(root, V + "llama_eagle3.py:286") == "aux_output = hidden_states if self.norm_output else hidden_prenorm"


def test_installed_vllm_matches_033_in_kind_and_use():
    """vLLM 0.32 (installed): the same answers as 0.33.0; each use line is the use it names."""
    loc = installed_engine("vllm")
    for arch, want in VLLM_033.items():
        got = states(loc, arch)
        assert {f: s for f, (s, _, _) in got.items()} == {f: s for f, (s, _, _) in want.items()}
        for flag, (_, _, used) in got.items():
            if used is not None:
                text = line_at(loc.root, used)
                assert "_residual_norm(" in text or "norm_before_fc" in text or "fc_norm" in text \
                    or "norm_output" in text, (flag, used, text)


def test_installed_sglang_each_flag():
    loc = installed_engine("sglang")
    s = "sglang/srt/models/"
    got = states(loc, "LlamaForCausalLMEagle3")
    assert got["norm_before_residual"] == ("not_read", None, None)
    assert {f: st for f, (st, _, _) in got.items()} == {
        "norm_before_residual": "not_read", "norm_before_fc": "used", "fc_norm": "used", "norm_output": "used"}
    assert all(w.startswith(s + "llama_eagle3.py:") for f, (_, w, _) in got.items() if f != "norm_before_residual")
    assert line_at(loc.root, got["norm_before_fc"][2]) == "if self.input_norm is not None:"  # via `if self.norm_before_fc:`
    assert line_at(loc.root, got["fc_norm"][2]) == "if self.fc_norm is not None:"
    assert line_at(loc.root, got["norm_output"][2]).startswith("aux = hidden_states_to_logits if self.norm_output")
    kimi = states(loc, "Eagle3DeepseekV2ForCausalLM")  # kimi_k25_eagle3.py: never reads norm_before_fc either
    assert {f: st for f, (st, _, _) in kimi.items()} == {
        "norm_before_residual": "not_read", "norm_before_fc": "not_read", "fc_norm": "used", "norm_output": "used"}


def test_old_releases_read_nothing_but_norm_before_residual():
    assert set(states(locate_engine("sglang", release_engine("sglang", "0.5.5")), "LlamaForCausalLMEagle3").values()) \
        == {("not_read", None, None)}
    old = states(locate_engine("vllm", release_engine("vllm", "0.11.0")), "LlamaForCausalLMEagle3")
    assert old["norm_before_residual"] == ("used", V + "llama_eagle3.py:52", V + "llama_eagle3.py:81")
    assert {old[f] for f in FLAGS[1:]} == {("not_read", None, None)}


@pytest.mark.parametrize("root", [None, "0.33.0"])
def test_vllm_speculators_translation_defaults_norm_before_residual_true(root):
    loc = locate_engine("vllm", release_engine("vllm", root) if root else None)
    reading = read_norms(loc, {"speculators_model_type": "eagle3"})
    t = reading.translation["norm_before_residual"]
    assert t.where == "vllm/transformers_utils/configs/speculators/algos.py:33" and t.default is True
    assert {f: reading.translation[f].default for f in FLAGS[1:]} == dict.fromkeys(FLAGS[1:], False)


def _sglang_copy(tmp_path):
    src = installed_engine("sglang").root / "srt/models/llama_eagle3.py"
    root = tmp_path / "sglang"
    (root / "srt" / "models").mkdir(parents=True)
    model = root / "srt/models/llama_eagle3.py"
    shutil.copy(src, model)
    return root, model


def test_sglang_norm_output_use_deleted_is_read_but_unused(tmp_path):
    """Before: a copy of SGLang 0.5.23's llama_eagle3.py uses norm_output to pick the aux state.
    After: the same file with that use replaced by the pre-norm state (the read kept)."""
    root, model = _sglang_copy(tmp_path)
    s = spec(tmp_path, "norm_output: true")
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "norm_output": True}
    before = states(locate_engine("sglang", root), "LlamaForCausalLMEagle3")["norm_output"]
    assert before[0] == "used" and errors(norm_lines(s, "sglang", cfg, root)) == []
    text = model.read_text()
    use = "aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux"
    assert text.count(use) == 1 and 'self.norm_output = getattr(config, "norm_output", False)' in text
    model.write_text(text.replace(use, "aux = hidden_states_to_aux"))
    after = states(locate_engine("sglang", root), "LlamaForCausalLMEagle3")["norm_output"]
    assert after == ("read_unused", before[1], None)
    bad = [(k, d) for sev, k, d in norm_lines(s, "sglang", cfg, root) if sev == "error"]
    assert len(bad) == 1 and bad[0][0] == "norm_unused"
    assert f"{before[1]}: reads config.norm_output, but no use of the value found" in bad[0][1]
    assert "`self.norm_output` (sglang/srt/models/llama_eagle3.py:" in bad[0][1] and "is never read" in bad[0][1]
    # a draft trained without the flag is served right either way
    assert errors(norm_lines(spec(tmp_path, "norm_output: false"), "sglang", {**cfg, "norm_output": False}, root)) == []


def test_sglang_norm_module_built_but_never_applied_is_unused(tmp_path):
    """`if self.norm_before_fc: self.input_norm = RMSNorm(...)` builds the norm; with forward's
    `if self.input_norm is not None:` block gone, nothing applies it: read but unused."""
    root, model = _sglang_copy(tmp_path)
    text = model.read_text()
    use = "            if self.input_norm is not None:\n                hidden_states = self.input_norm(hidden_states)\n"
    assert text.count(use) == 1
    model.write_text(text.replace(use, ""))
    got = states(locate_engine("sglang", root), "LlamaForCausalLMEagle3")
    assert got["norm_before_fc"][0] == "read_unused" and got["fc_norm"][0] == "used"


def test_vllm_residual_norm_use_deleted_is_read_but_unused(tmp_path):
    """Before/after on vLLM 0.33.0's llama_eagle3.py: the layer's forward calls the method the
    flag selected; after, it calls the after-residual norm itself (the read and the selection kept)."""
    root, (model,) = vllm_models_copy(tmp_path, "llama_eagle3.py")
    s = spec(tmp_path, "norm_before_residual: true")
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "norm_before_residual": True}
    assert errors(norm_lines(s, "vllm", cfg, root)) == []
    text = model.read_text()
    use = "self._residual_norm(hidden_states=hidden_states)"
    assert text.count(use) == 1
    model.write_text(text.replace(use, "self._norm_after_residual(hidden_states=hidden_states)"))
    got = states(locate_engine("vllm", root), "LlamaForCausalLMEagle3")
    assert got["norm_before_residual"] == ("read_unused", V + "llama_eagle3.py:101", None)
    bad = errors(norm_lines(s, "vllm", cfg, root))
    assert len(bad) == 1 and bad[0].startswith("norm_before_residual: the draft needs True")
    assert "`self._residual_norm` (vllm/model_executor/models/llama_eagle3.py:102) is never read" in bad[0]


FAKE = '''\
from typing import TYPE_CHECKING

from elsewhere import build_norm


class Layer:
    def __init__(self, config, norm_first=False, eps=1e-6):
        self.norm_first = norm_first

    def forward(self, x):
        if self.norm_first:
            x = self.norm(x)
        return x


class Model:
    def __init__(self, config):
        self.layer = Layer(config, getattr(config, "norm_before_residual", False))
        out = getattr(config, "norm_output", False)
        self.fc_norm = build_norm(getattr(config, "fc_norm", False))
        self.unused = bool(getattr(config, "norm_before_fc", False))
        if TYPE_CHECKING:
            if self.unused:
                print(out)


EntryClass = [Model]
'''


def test_followed_into_a_constructor_and_out_of_the_file(tmp_path):
    """A flag passed to a decoder layer class of the same file is followed into its __init__ and
    forward; one passed to another module's function is unverified; a local nobody reads and a use
    under TYPE_CHECKING are no use."""
    root = tmp_path / "sglang"
    (root / "srt" / "models").mkdir(parents=True)
    (root / "srt/models/fake.py").write_text(FAKE)
    got = states(locate_engine("sglang", root), "Model")
    f = "sglang/srt/models/fake.py"
    assert got["norm_before_residual"] == ("used", f"{f}:18", f"{f}:11")
    assert got["fc_norm"] == ("unverified", f"{f}:20", None)
    assert got["norm_output"] == ("read_unused", f"{f}:19", None)
    assert got["norm_before_fc"] == ("read_unused", f"{f}:21", None)
    reading = read_norms(locate_engine("sglang", root), {"architectures": ["Model"]})
    fc = reading.state("fc_norm")[1]
    assert fc.use.at == f"{f}:20" and "passes it to `build_norm`, which is not in" in fc.use.how
    assert "dead code" in reading.state("norm_before_fc")[1].use.how
    chain = reading.state("norm_before_residual")[1].use.how
    assert "passes it to `Layer` as `norm_first`" in chain and "stores it in `self.norm_first`" in chain
    # check-draft: unverified is a warning that says so, not an error; unused is an error
    lines = norm_lines(spec(tmp_path, "norm_before_fc: true"), "sglang",
                       {"architectures": ["Model"], "norm_before_fc": True}, root)
    assert [(sev, k) for sev, k, _ in lines if k != "norm"] == [("error", "norm_unused")]
    lines = norm_lines(spec(tmp_path, "fc_norm: true"), "sglang", {"architectures": ["Model"], "fc_norm": True}, root)
    assert [(sev, k) for sev, k, _ in lines if k != "norm"] == [("warning", "norm_unverified")]


def errors(lines):
    return [d for sev, _, d in lines if sev == "error"]


def test_check_draft_json_reports_each_flag(tmp_path):
    installed_engine("sglang")
    f = norms_spec(tmp_path, "norm_before_residual: true, fc_norm: true")
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], **IDS,
                                               "norm_before_residual": True, "fc_norm": True}))
    data = json.loads(cli_run("check-draft", f, d, "--engine", "sglang", "--json", code=3).stdout)
    jsonschema.validate(data, output_schema("check-draft"))
    norms = {n["flag"]: n for n in data["norms"]}
    assert list(norms) == list(FLAGS)
    assert norms["norm_before_residual"]["state"] == "not_read" and norms["norm_before_residual"]["needs"] is True
    assert norms["fc_norm"]["state"] == "used" and norms["fc_norm"]["used_at"].startswith("sglang/srt/models/llama_eagle3.py:")
    assert norms["fc_norm"]["builds"] is True and norms["fc_norm"]["read"].startswith("sglang/srt/models/llama_eagle3.py:")
    r = check_draft(load_spec(f), d, "vllm")
    assert [n.state for n in r.norms] == ["used"] * 4


def test_use_only_in_a_branch_dead_for_eagle3(tmp_path):
    """Before/after on vLLM 0.33.0's llama_eagle3.py: norm_output's use moved into an arm that
    runs only when use_aux_hidden_state is false (never for an EAGLE-3 draft) -> read but unused."""
    root, (model,) = vllm_models_copy(tmp_path, "llama_eagle3.py")
    use = "        aux_output = hidden_states if self.norm_output else hidden_prenorm\n"
    text = model.read_text()
    assert text.count(use) == 1
    model.write_text(text.replace(use, "        aux_output = hidden_prenorm\n        if not self.use_aux_hidden_state:\n    "
                                       + use))
    reading = read_norms(locate_engine("vllm", root), {"architectures": ["LlamaForCausalLMEagle3"]})
    state, read = reading.state("norm_output")
    assert state == "read_unused" and read.where == V + "llama_eagle3.py:252"
    assert "`if not self.use_aux_hidden_state` (vllm/model_executor/models/llama_eagle3.py:287)" in read.use.how
    assert "dead for EAGLE-3" in read.use.how
    s = spec(tmp_path, "norm_output: true")
    bad = errors(norm_lines(s, "vllm", {"architectures": ["LlamaForCausalLMEagle3"], "norm_output": True}, root))
    assert len(bad) == 1 and bad[0].startswith("norm_output: the draft needs True")
    assert reading.state("norm_before_fc")[0] == "used"  # the other flags keep their uses
