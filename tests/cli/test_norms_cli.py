"""The norm flags and the MTP input point through the CLI: bad input is one located line and exit 2,
a draft served wrong is exit 3."""

import json

from tests.conftest import cli_run as run
from tests.conftest import norms_spec


def write(tmp_path, norms="", config=None):
    f = norms_spec(tmp_path, tail=norms)
    c = tmp_path / "config.json"
    c.write_text(json.dumps(config or {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}))
    return f, c


def test_bad_norm_flag_in_the_spec_is_located(tmp_path):
    f, c = write(tmp_path, ", norms: {norm_output: maybe}")
    res = run("check-draft", f, c, "--engine", "sglang", code=2)
    line = res.stderr.strip()
    assert "\n" not in line and f"{f}:8:72: " in line and "draft.norms.norm_output" in line


def test_non_bool_flag_in_the_draft_config(tmp_path):
    f, c = write(tmp_path, config={"norm_before_fc": "yes"})
    res = run("check-draft", f, c, "--engine", "sglang", code=2)
    assert "norm_before_fc must be true or false" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_ignored_flag_is_exit_3(tmp_path):
    f, c = write(tmp_path, ", norms: {norm_before_residual: true}",
                 {"norm_before_residual": True, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}})
    res = run("check-draft", f, c, "--engine", "sglang", "--json", code=3)
    kinds = [x["kind"] for x in json.loads(res.stdout)["findings"] if x["severity"] == "error"]
    assert kinds == ["norm_ignored"]
