"""The trainers' reading of the EAGLE 3.1 norm flags, from their real sources (SpecForge 0.2.0 and
speculators 0.9.0, fetched into .engines by scripts/fetch-engines), the cited table's checker, and
before/after edits of copied sources that change the answer."""

import importlib.util
import json
import shutil

import pytest

from surgeon.core.errors import BadInput
from surgeon.core.spec import load_spec
from surgeon.engines.facts import trainer_norms
from surgeon.engines.facts.trainer_norms import (
    SPECFORGE_TABLE,
    check,
    logits_only,
    open_trainer,
    read_specforge,
    speculators_defaults,
)
from surgeon.wiring.draft import check_draft
from surgeon.wiring.norms import render_lines, trained_defaults, wanted
from tests.conftest import cli_run, norms_spec, release_engine

IDS = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}
MODEL = "modeling/draft/llama3_eagle.py"


def spec(tmp_path, norms=""):
    return norms_spec(tmp_path, norms)


def draft(tmp_path, arch="LlamaForCausalLMEagle3", **config):
    d = tmp_path / "draft"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": [arch], **IDS, **config}))
    return d


def copy(tmp_path, dist, version):
    """A writable copy of the fetched release, as a checkout root holding ``<dist>/``."""
    dest = tmp_path / f"{dist}-copy"
    shutil.copytree(release_engine(dist, version), dest / dist)
    return dest


def edit(path, old, new):
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def errors(report):
    return {(f.kind, f.detail.split(":")[0]) for f in report.findings if f.severity == "error"}


def test_the_checker_confirms_the_cited_table_on_the_fetched_release():
    out = check("specforge", str(release_engine("specforge", "0.2.0").parent))
    assert not [x for x in out if x.startswith("DIFFERS")], out
    assert out[0].startswith("specforge 0.2.0 at ")
    assert f"fc_norm: used at specforge/{MODEL}:1764" in out and "norm_before_fc: not_read" in out
    assert trainer_norms.main(["specforge", str(release_engine("specforge", "0.2.0").parent)]) == 0
    assert trainer_norms.main(["speculators", str(release_engine("speculators", "0.9.0").parent)]) == 0


def test_the_checker_reports_an_edited_cited_line_and_a_changed_answer(tmp_path, capsys):
    root = copy(tmp_path, "specforge", "0.2.0")
    assert (MODEL, 1679, 'if getattr(config, "fc_norm", False):') in SPECFORGE_TABLE
    edit(root / "specforge" / MODEL, 'getattr(config, "fc_norm", False)', 'getattr(config, "use_fc_norm", False)')
    out = check("specforge", str(root))
    assert "fc_norm: not_read" in out
    assert f"DIFFERS: fc_norm: cited used {MODEL}:1764" in out
    assert any(x.startswith(f"DIFFERS: specforge/{MODEL}:1679: cited") for x in out), out
    assert trainer_norms.main(["specforge", str(root)]) == 1
    assert "differs" in capsys.readouterr().out


def test_the_checker_refuses_a_folder_that_is_no_source(tmp_path, capsys):
    assert trainer_norms.main(["specforge", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not a specforge source" in err
    with pytest.raises(BadInput, match="not a speculators source"):
        open_trainer("speculators", tmp_path)


def test_check_draft_specforge_reports_each_flag_from_its_source(tmp_path):
    f = spec(tmp_path, "norm_before_residual: true, fc_norm: true, norm_output: true")
    d = draft(tmp_path, norm_before_residual=True, fc_norm=True, norm_output=True)
    res = cli_run("check-draft", f, d, "--engine", "specforge", "--json", code=3)
    out = json.loads(res.stdout)
    norms = {n["flag"]: n for n in out["norms"]}
    assert norms["norm_before_residual"]["state"] == "not_read" and not norms["norm_before_residual"]["builds"]
    assert norms["norm_before_fc"]["state"] == "not_read"
    assert norms["fc_norm"]["used_at"] == f"specforge/{MODEL}:1764" and norms["fc_norm"]["builds"]
    assert norms["norm_output"]["state"] == "used" and norms["norm_output"]["used_at"] == f"specforge/{MODEL}:1773"
    assert not norms["norm_output"]["builds"] and norms["norm_output"]["needs"]  # used only for the logits
    assert "compute_logits" in norms["norm_output"]["detail"] and "PR #879" in norms["norm_output"]["detail"]
    kinds = {(x["kind"], x["detail"].split(":")[0]) for x in out["findings"] if x["severity"] == "error"}
    assert kinds == {("norm_ignored", "norm_before_residual"), ("norm_mismatch", "norm_output")}


def test_a_draft_specforge_trains_as_it_needs_passes(tmp_path):
    s = load_spec(spec(tmp_path, "fc_norm: true"))
    r = check_draft(s, draft(tmp_path, fc_norm=True), "specforge")
    assert r.ok, r.findings
    assert any(f.kind == "norm" and "specforge 0.2.0 trains it so" in f.detail for f in r.findings)


def test_norm_output_false_trains_lm_head_on_the_unnormed_state(tmp_path):
    s = load_spec(spec(tmp_path, "norm_output: false"))
    r = check_draft(s, draft(tmp_path, norm_output=False), "specforge")
    assert ("norm_mismatch", "norm_output") in errors(r)
    assert any("neither EAGLE-3 nor EAGLE 3.1" in f.detail for f in r.findings)
    assert not any(f.kind == "norm" and f.detail.startswith("norm_output") for f in r.findings)  # no "trains it so"
    rendered = render_lines(s, "specforge")  # render refuses to write the config check-draft rejects
    assert len(rendered) == 1 and "NOT TRAINED" in rendered[0] and "un-normed" in rendered[0], rendered
    res = cli_run("render", s.file, "--engine", "specforge", code=2)
    assert "NOT TRAINED" in res.output and len(res.output.strip().splitlines()) == 1


def test_norm_output_moved_into_the_fed_back_state_is_trained(tmp_path):
    """Before: used in compute_logits only (not trained); after: the backbone returns the normed
    state under norm_output (as SpecForge PR #879 intends): trained as the draft needs."""
    root = copy(tmp_path, "specforge", "0.2.0")
    s = load_spec(spec(tmp_path, "norm_output: true"))
    d = draft(tmp_path, norm_output=True)
    assert ("norm_mismatch", "norm_output") in errors(check_draft(s, d, "specforge", engine_root=root))
    model = root / "specforge" / MODEL
    edit(model, "        if self.norm_output:\n            norm_hidden_states = self.norm(hidden_states)\n"
                "        else:\n            norm_hidden_states = hidden_states\n        return self.lm_head(norm_hidden_states)",
         "        return self.lm_head(self.norm(hidden_states))")
    edit(model, "        return self.midlayer(\n            input_emb=input_embeds,",
         "        out = self.midlayer(\n            input_emb=input_embeds,")
    model.write_text(model.read_text() + "        return self.norm(out) if self.norm_output else out\n")
    src = open_trainer("specforge", root)
    assert src is not None and logits_only(src, read_specforge(src, {})) is None
    after = check_draft(s, d, "specforge", engine_root=root)
    assert after.ok, after.findings
    n = next(x for x in after.norms if x.flag == "norm_output")
    assert n.builds and n.state == "used" and n.used_at is not None and "compute_logits" not in n.detail


def test_a_dropped_read_is_an_error_after_the_edit(tmp_path):
    root = copy(tmp_path, "specforge", "0.2.0")
    s = load_spec(spec(tmp_path, "fc_norm: true"))
    d = draft(tmp_path, fc_norm=True)
    assert check_draft(s, d, "specforge", engine_root=root).ok
    edit(root / "specforge" / MODEL, 'getattr(config, "fc_norm", False)', 'getattr(config, "use_fc_norm", False)')
    assert errors(check_draft(s, d, "specforge", engine_root=root)) == {("norm_ignored", "fc_norm")}


def test_the_draft_class_is_found_by_its_registration(tmp_path):
    s = load_spec(spec(tmp_path, "norm_before_residual: true"))
    r = check_draft(s, draft(tmp_path, arch="PEagleDraftModel", norm_before_residual=True), "specforge")
    n = next(x for x in r.norms if x.flag == "norm_before_residual")
    assert n.state == "used" and n.used_at == "specforge/modeling/draft/peagle.py:126" and n.builds
    missing = check_draft(s, draft(tmp_path, arch="NoSuchDraft"), "specforge")
    assert missing.norms == [] and any(f.kind == "norm_unchecked" and "'NoSuchDraft'" in f.detail
                                       for f in missing.findings)


def test_render_says_what_specforge_trains(tmp_path):
    lines = render_lines(load_spec(spec(tmp_path, "fc_norm: true, norm_output: true")), "specforge")
    assert lines[0].startswith(f"specforge: norm flag fc_norm = True: used at specforge/{MODEL}:1764")
    assert "NOT TRAINED" in lines[1] and "compute_logits" in lines[1]


def test_speculators_defaults_are_read_from_its_config_class(tmp_path):
    src = open_trainer("speculators", release_engine("speculators", "0.9.0").parent)
    assert src is not None and src.version == "0.9.0"
    got = speculators_defaults(src)
    assert got == {"norm_before_residual": (False, "speculators/models/eagle3/config.py:43"),
                   "norm_before_fc": (False, "speculators/models/eagle3/config.py:58"),
                   "fc_norm": (False, "speculators/models/eagle3/config.py:66"),
                   "norm_output": (False, "speculators/models/eagle3/config.py:76")}
    want = wanted(load_spec(spec(tmp_path)), {})
    assert want["norm_output"] == (False, "unset (speculators 0.9.0's default, speculators/models/eagle3/config.py:76; "
                                          "its model uses it at speculators/models/eagle3/core.py:302)")
    assert "model_definitions.py:80" in want["norm_before_residual"][1]  # followed into the first-layer class


def test_a_default_speculators_never_uses_trains_nothing(tmp_path, capsys):
    """Before: a default of True in a copied config.py is what an unset norm_output needs; after
    core.py's one use of it is removed, its model never builds the norm: the unset flag needs False,
    and the checker reports the changed answer."""
    root = copy(tmp_path, "speculators", "0.9.0")
    pkg = root / "speculators" / "models" / "eagle3"
    edit(pkg / "config.py", "    norm_output: bool = Field(\n        default=False,",
         "    norm_output: bool = Field(\n        default=True,")
    assert trained_defaults(root)["norm_output"][0] is True
    edit(pkg / "core.py", "            if self.config.norm_output:\n", "            if False:\n")
    need, why = trained_defaults(root)["norm_output"]
    assert need is False and "never uses it: trained without it" in why
    assert trainer_norms.main(["speculators", str(root)]) == 1
    out = capsys.readouterr().out
    assert "norm_output: not_read" in out and "DIFFERS: norm_output: cited used at models/eagle3/core.py:302" in out


def test_an_edited_speculators_default_changes_what_an_unset_flag_needs(tmp_path, monkeypatch):
    """Before: norm_output unset needs False (vLLM builds False: fine); after the default in a
    copied config.py becomes True, the unset flag needs True and vLLM's build is an error."""
    s = load_spec(spec(tmp_path))
    d = draft(tmp_path)
    assert ("norm_output" not in {k for _, k in errors(check_draft(s, d, "vllm"))})
    repo = tmp_path / "repo"
    release = release_engine("speculators", "0.9.0").parent
    shutil.copytree(release, repo / ".engines" / release.name)
    cfg = repo / ".engines" / release.name / "speculators" / "models" / "eagle3" / "config.py"
    edit(cfg, "    norm_output: bool = Field(\n        default=False,", "    norm_output: bool = Field(\n        default=True,")
    assert trained_defaults(repo / ".engines" / release.name)["norm_output"][0] is True
    monkeypatch.setattr(trainer_norms, "REPO_ROOT", repo)
    after = check_draft(s, d, "vllm")
    assert any(k == "norm_output" for _, k in errors(after)), after.findings
    assert any("speculators 0.9.0's default, speculators/models/eagle3/config.py:76" in f.detail for f in after.findings)


def test_render_for_specforge_refuses_a_flag_it_would_train_without(tmp_path):
    res = cli_run("render", spec(tmp_path, "norm_before_residual: true"), "--engine", "specforge", code=2)
    line = res.stderr.strip()
    assert "\n" not in line and "cannot render for specforge" in line and "never reads norm_before_residual" in line
    ok = cli_run("render", spec(tmp_path, "fc_norm: true"), "--engine", "specforge")
    assert f"fc_norm = True: used at specforge/{MODEL}:1764" in ok.stdout and '"fc_norm": true' in ok.stdout


def test_the_newest_fetched_release_is_read_by_version_not_by_name(tmp_path, monkeypatch):
    """.engines keeps old releases after a pin bump: 0.10.0 must win over 0.2.0 (a string sort
    would take 0.2.0)."""
    release = release_engine("specforge", "0.2.0").parent
    repo = tmp_path / "repo"
    for version in ("0.2.0", "0.10.0"):
        dest = repo / ".engines" / f"specforge-{version}"
        shutil.copytree(release, dest)
        (dest / ".complete").touch()
    monkeypatch.setattr(trainer_norms, "REPO_ROOT", repo)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    src = open_trainer("specforge")
    assert src is not None and src.package == (repo / ".engines" / "specforge-0.10.0" / "specforge").resolve()


@pytest.mark.parametrize("change, needle", [
    (("    fc_norm: bool = Field(\n        default=False,", "    fc_norm: bool = Field(\n        default=bool(0),"),
     "no literal True/False default"),
    (("class Eagle3SpeculatorConfig(", "class RenamedSpeculatorConfig("), "no class Eagle3SpeculatorConfig"),
])
def test_a_speculators_default_that_cannot_be_read_is_a_warning_not_a_guess(tmp_path, monkeypatch, change, needle):
    """A present speculators source whose default is not a literal (or whose config class is gone):
    the unset flag is taken as False and check-draft says so in a warning, on every engine, instead
    of stating 'its source is not on this machine' or failing the whole command."""
    repo = tmp_path / "repo"
    release = release_engine("speculators", "0.9.0").parent
    shutil.copytree(release, repo / ".engines" / release.name)
    edit(repo / ".engines" / release.name / "speculators" / "models" / "eagle3" / "config.py", *change)
    monkeypatch.setattr(trainer_norms, "REPO_ROOT", repo)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    r = check_draft(load_spec(spec(tmp_path)), draft(tmp_path), "vllm")
    warned = [f.detail for f in r.findings if f.severity == "warning" and f.kind == "norm_unchecked"]
    assert any(needle in w and "not read from its source" in w for w in warned), r.findings
    assert not any("not on this machine" in f.detail for f in r.findings)
