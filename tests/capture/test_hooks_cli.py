"""The hooks and dumps pieces wired together as an engine would use them: generate the hooks
module from a spec, capture through it in a decoder loop that carries the residual separately,
drain into the asynchronous writer, read the dump back, export it; and the CLI shells."""

import json

import torch

from surgeon.capture.dumps import read_dump
from surgeon.capture.dumpwriter import DumpWriter, list_shards
from surgeon.capture.exporters import export_specforge
from surgeon.capture.hooks import generate_hooks_module, load_hooks_module
from surgeon.core.points import FINAL_NORM, layer_out
from surgeon.core.spec import load_spec
from tests.conftest import cli_run as run

SPEC = """\
spec: 1
name: hooks-e2e
target: {architecture: LlamaForCausalLM, num_layers: 6, hidden_size: 32}
captures: {low: 'layer_out[1]', mid: 'layer_out[3]', high: 'layer_out[4]', last: final_norm}
draft: {kind: eagle3, fc_input: [low, mid, high], fc_in_features: 96}
"""


def _forward(hooks, module, x, layers, norm):
    """A fused-residual decoder loop, with the calls a patch inserts."""
    hooks.begin_step(module, x.shape[0])
    hidden, residual = x, None
    hooks.capture_position(module, 0, hidden, residual)
    for k, layer in enumerate(layers):
        residual = hidden if residual is None else hidden + residual
        hidden = torch.tanh(layer(residual))
        hooks.capture_position(module, k + 1, hidden, residual)
    out = norm(hidden + residual)
    hooks.capture_final(module, out)
    return out


def test_drain_into_the_writer_and_export(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text(SPEC)
    spec = load_spec(f)
    hooks = load_hooks_module(generate_hooks_module(spec, mode="dump", max_tokens=64), "_surgeon_hooks_e2e")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 32) for _ in range(6)]
    norm = torch.nn.LayerNorm(32)
    module = torch.nn.Module()
    expected = []
    with DumpWriter(tmp_path / "dumps", spec=spec, engine="test") as w:
        for step in range(3):
            x = torch.randn(10 + step, 32)
            with torch.no_grad():
                out = _forward(hooks, module, x, layers, norm)
                # what each point is, computed independently of the hooks
                h, r, states = x, None, {}
                for k, layer in enumerate(layers):
                    r = h if r is None else h + r
                    h = torch.tanh(layer(r))
                    states[layer_out(k)] = h + r
                states[FINAL_NORM] = out
            expected.append(states)
            drained = hooks.drain(module, x.shape[0])
            w.submit([(n, spec.captures[n], t) for n, _, t in drained], torch.arange(x.shape[0]))
    shards = list_shards(tmp_path / "dumps")
    assert len(shards) == 3
    for shard, states in zip(shards, expected):
        d = read_dump(shard)
        for name, point, t in d.captures:
            assert point == spec.captures[name] and torch.allclose(t, states[point], atol=1e-6)
    written = export_specforge(shards, tmp_path / "sf", spec=spec)
    data = torch.load(written[0], weights_only=True)
    assert torch.allclose(data["hidden_state"][0], expected[0][FINAL_NORM], atol=1e-6)
    info = json.loads(run("dump-info", shards[0], "--json").stdout)
    assert [c["point"] for c in info["captures"]] == ["layer_out[1]", "layer_out[3]", "layer_out[4]", "final_norm"]
    run("export", shards[0], "--spec", f, "--layout", "specforge", "-o", tmp_path / "sf2")
    refused = run("export", shards[0], "--spec", f, "--layout", "speculators", "-o", tmp_path / "sp", code=2)
    assert "layer_out[5]" in refused.stderr


def test_hooks_and_check_hooks_commands(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text(SPEC)
    out = tmp_path / "_surgeon_hooks.py"
    run("hooks", f, "--mode", "aux", "--max-tokens", 128, "-o", out)
    assert "no graph-unsafe" in run("check-hooks", out).output
    run("hooks", f, "--mode", "aux", "--max-tokens", 128, "-o", out, code=2)  # no overwrite
    bad = tmp_path / "bad_hook.py"
    bad.write_text("import torch\n\ndef capture(module, hidden_states):\n"
                   "    n = hidden_states.sum().item()\n    torch.save(hidden_states, 'x.pt')\n")
    r = json.loads(run("check-hooks", bad, "--json", code=3).stdout)
    assert {x["rule"] for x in r["findings"]} >= {"host-sync", "io"}
    assert r["findings"][0]["line"] == 4


def test_export_writes_nothing_when_any_shard_cannot_fill_the_layout(tmp_path):
    from surgeon.capture.dumps import write_dump
    from surgeon.core.errors import BadInput

    f = tmp_path / "s.yaml"
    f.write_text(SPEC)
    spec = load_spec(f)
    ids = torch.arange(4)
    full = [(n, spec.captures[n], torch.randn(4, 32)) for n in ("low", "mid", "high", "last")]
    good = write_dump(tmp_path / "a.safetensors", full, input_ids=ids, num_layers=6, spec=spec)
    bad = write_dump(tmp_path / "b.safetensors", full[:3], input_ids=ids, num_layers=6, spec=spec)  # no final_norm
    out = tmp_path / "sf"
    try:
        export_specforge([good, bad], out, spec=spec)
    except BadInput as e:
        assert "final_norm" in str(e)
    else:
        raise AssertionError("export should refuse")
    assert not out.exists() or not any(out.iterdir())
