"""What people read: "exact" instead of a capped margin, the diagnosis that explains the most
slots first, the heatmap's axis titles and exact-match marks, progress with elapsed time (the demo's
minute-long vLLM step included), and review Markdown that GitHub renders as meant (parsed here with
markdown-it-py, a CommonMark parser with GFM tables)."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from markdown_it import MarkdownIt
from rich.console import Console

from surgeon.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "specs" / "demo-tiny-llama-eagle3.yaml"
KIMI = ROOT / "specs" / "kimi-k2.5-eagle3.yaml"
LLAMA = ROOT / "specs" / "llama-3.1-8b-eagle3.yaml"


def invoke(*args, code: int = 0):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == code, (args, res.exit_code, res.output)
    return res


def miswired(tmp_path: Path) -> Path:
    """The demo's mis-wiring: its captures labelled [embed, layer_out[1], layer_out[3]]."""
    from surgeon.run.demo import _wrong_spec_text

    f = tmp_path / "miswired.yaml"
    f.write_text(_wrong_spec_text(DEMO.read_text()))
    return f


# -- margins and diagnoses --------------------------------------------------------------------------
def test_an_exact_match_says_exact_not_a_capped_margin(harness):
    out = invoke("match", harness / "dump.safetensors", "--reference", harness / "ref.safetensors").output
    assert "exact" in out and "1000000" not in out


def test_the_demo_miswiring_is_told_as_labels_shifted_by_one_slot(harness, tmp_path):
    res = invoke("verify", miswired(tmp_path), "--subject", harness / "dump.safetensors",
                 "--reference", harness / "ref.safetensors", "--json", code=3)
    diagnosis = json.loads(res.stdout)["diagnosis"]
    assert [d["kind"] for d in diagnosis] == ["labels_shifted"], diagnosis  # not "off by +2 layers"
    assert "'high' holds layer_out[5], whose label was pushed off the end" in diagnosis[0]["detail"]


# -- the heatmap ------------------------------------------------------------------------------------
def test_heatmap_has_axis_titles_and_marks_exact_matches(harness, tmp_path):
    import torch

    from surgeon.core.spec import load_spec
    from surgeon.verify.harness import heatmap_figure, match
    from surgeon.verify.reference import load_reference

    ref = load_reference(harness / "ref.safetensors")
    exact = match(harness / "dump.safetensors", str(harness / "ref.safetensors"), spec=load_spec(DEMO))
    rounded = tmp_path / "bf16.pt"  # a bf16 engine's capture: matched, but not bit for bit
    torch.save([ref.states[p].bfloat16() for p in exact.report.candidates[2:4]], rounded)
    inexact = match(rounded, str(harness / "ref.safetensors"), input_ids=",".join(map(str, ref.input_ids.tolist())))
    assert all(s.exact for s in exact.report.slots) and not any(s.exact for s in inexact.report.slots)
    for result, marker in ((exact, "*"), (inexact, ".")):
        fig = heatmap_figure(result)
        ax = fig.axes[0]
        assert "reference point" in ax.get_xlabel() and "slot" in ax.get_ylabel()
        assert "relative error" in fig.axes[1].get_ylabel()  # the colour bar says what the colour is
        marks = [(line.get_marker(), int(line.get_xdata()[0]), int(line.get_ydata()[0])) for line in ax.get_lines()]
        cands = [str(c) for c in result.report.candidates]
        assert marks == [(marker, cands.index(str(s.matched)), i) for i, s in enumerate(result.report.slots)]
    png = tmp_path / "heat.png"
    invoke("match", harness / "dump.safetensors", "--reference", harness / "ref.safetensors", "--plot", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- review Markdown as GitHub renders it ------------------------------------------------------------
def _blocks(markdown: str) -> list[tuple[str, object]]:
    """Top-level blocks: ("table", [rows as lists of cell texts]), ("list", [item texts]),
    ("paragraph", text), ("heading", text), ... (GFM tables on, HTML allowed as GitHub does)."""
    tokens = MarkdownIt("commonmark", {"html": True}).enable("table").parse(markdown)
    blocks: list[tuple[str, object]] = []
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t.type == "table_open":
            rows: list[list[str]] = []
            while tokens[i].type != "table_close":
                if tokens[i].type == "tr_open":
                    rows.append([])
                elif tokens[i].type == "inline":
                    rows[-1].append(tokens[i].content)
                i += 1
            blocks.append(("table", rows))
        elif t.type == "ordered_list_open":
            items = []
            while tokens[i].type != "ordered_list_close":
                if tokens[i].type == "inline":
                    items.append(tokens[i].content)
                i += 1
            blocks.append(("list", items))
        elif t.type in ("heading_open", "paragraph_open"):
            blocks.append((t.type.split("_")[0], tokens[i + 1].content))
            i += 2
        elif t.type == "html_block":
            blocks.append(("html", t.content.strip()))
        i += 1
    return blocks


def _table_after(blocks, heading: str) -> tuple[list[list[str]], list]:
    """The table under ``heading`` and the blocks after it, up to the next heading."""
    at = blocks.index(("heading", heading))
    kind, rows = blocks[at + 1]
    assert kind == "table", blocks[at + 1]
    rest = []
    for b in blocks[at + 2:]:
        if b[0] == "heading":
            break
        rest.append(b)
    return rows, rest


def test_review_engine_ids_table_has_its_rows_and_the_notes_below_it(tmp_path):
    fixed = tmp_path / "kimi-fix.yaml"  # the "fix" that redeployed the Kimi draft with ids [-1, 2, 30]
    fixed.write_text(KIMI.read_text().replace("low: layer_out[2]", "emb: embed")
                     .replace("mid: layer_out[30]", "low: layer_out[2]").replace("high: layer_out[58]", "mid: layer_out[30]")
                     .replace("[low, mid, high]", "[emb, low, mid]").replace("[low, mid, high, last]", "[low, mid, last]"))
    md = invoke("review", KIMI, fixed).output
    blocks = _blocks(md)
    rows, below = _table_after(blocks, "Engine ids")
    assert [r[0].split(" (")[0] for r in rows] == ["consumer", "SGLang `eagle_config` ids",
                                                   "vLLM `eagle_aux_hidden_state_layer_ids`",
                                                   "SpecForge / EAGLE config ids", "HF `hidden_states` indices"]
    assert all(len(r) == 3 for r in rows)  # no note or origin line became a row
    notes = [b for b in below if b[0] == "list"]
    assert len(notes) == 1 and len(notes[0][1]) == len(set(notes[0][1])) >= 1  # each note once
    assert any("embed" in n for n in notes[0][1])  # SpecForge cannot name embed
    assert "not expressible (note " in rows[3][2]
    # and vLLM's DeepseekV3 cannot capture embed at all (an unguarded hidden_states + residual)
    assert "not expressible (note " in rows[2][2]
    origins = [b for b in below if "engine rules read from" in str(b[1])]
    assert len(origins) == 1 and "probe of sglang" in str(origins[0][1]) and "probe of vllm" in str(origins[0][1])
    assert md.count("probe of sglang") == 1  # said once


def test_review_note_repeated_in_cells_is_written_once(tmp_path):
    f = tmp_path / "x.yaml"  # a class no engine has: the same reason before and after
    f.write_text(LLAMA.read_text().replace("LlamaForCausalLM", "NoSuchArch").split("engines:")[0])
    g = tmp_path / "y.yaml"
    g.write_text(f.read_text().replace("layer_out[15]", "layer_out[16]"))
    md = invoke("review", f, g).output
    rows, below = _table_after(_blocks(md), "Engine ids")
    assert len(rows) == 5 and all(len(r) == 3 for r in rows)
    notes = next(b[1] for b in below if b[0] == "list")
    assert len(notes) == len(set(notes)) == 2  # one per engine, though each appears before and after
    assert rows[1][1] == rows[1][2] == "not expressible (note 1)" and rows[2][1] == rows[2][2] == "not expressible (note 2)"
    for heading in ("Captures", "fc input (the order the draft's fc concatenates)"):
        table, _ = _table_after(_blocks(md), heading)
        assert all(len(r) == 4 for r in table)


# -- progress ---------------------------------------------------------------------------------------
def test_heartbeat_reports_elapsed_time_of_the_current_step():
    from surgeon.commands.progress import Heartbeat

    beats: list[tuple[str, float]] = []
    with Heartbeat(lambda label, s: beats.append((label, s)), every_s=0.05) as hb:
        hb.step("first")
        time.sleep(0.3)
        hb.step("second")
        time.sleep(0.3)
        hb.step(None)
        n = len(beats)
        time.sleep(0.15)
    assert len(beats) == n  # no step: nothing to say
    firsts = [s for label, s in beats if label == "first"]
    seconds = [s for label, s in beats if label == "second"]
    assert len(firsts) >= 3 and len(seconds) >= 3
    assert firsts == sorted(firsts) and seconds[0] < firsts[-1]  # timed per step, growing


def test_spinners_and_bars_show_elapsed_time_on_a_terminal():
    from surgeon.cli_render import RichProgress

    buf = io.StringIO()
    progress = RichProgress(console=Console(file=buf, force_terminal=True, width=100))
    with progress.spinner("rewriting and applying"):
        time.sleep(0.3)
    with progress.bar("probing vllm source") as update:
        update(3, 10)
        time.sleep(0.3)
    text = buf.getvalue()
    assert "rewriting and applying" in text and "probing vllm source" in text and "0:00:00" in text
    quiet = io.StringIO()
    with RichProgress(as_json=True, console=Console(file=quiet, force_terminal=True)).spinner("x"):
        pass
    assert quiet.getvalue() == ""


def _fake_demo(harness, pause: float):
    """run_demo that takes ``pause`` seconds in its vLLM step, and a result the CLI can print."""
    from surgeon.core.spec import load_spec
    from surgeon.run.demo import DemoResult
    from surgeon.verify.harness import match

    dump, ref = harness / "dump.safetensors", harness / "ref.safetensors"
    right = match(dump, str(ref), spec=load_spec(DEMO))
    wrong = SimpleNamespace(**{**vars(right), "ok": False, "verdict": "mismatch",
                               "headline": "mismatch: 4 of 4 slots not what were declared"})

    def run_demo(work, *, step, note, engine_root=None):
        for title in ("making", "reference", "applying"):
            step(title)
        step("running the model on vLLM")
        time.sleep(pause)
        for title in ("reverting", "verifying", "checking a mis-wired variant"):
            step(title)
        return DemoResult(Path(work), harness / "model", DEMO, DEMO, ref, dump, harness / "a.png", harness / "b.png",
                          harness, "llama.py", right, wrong, True, {})

    return run_demo


def test_the_demo_vllm_step_is_not_silent_in_a_log(harness, monkeypatch, tmp_path):
    import surgeon.commands.progress
    import surgeon.run.demo

    monkeypatch.setattr(surgeon.run.demo, "run_demo", _fake_demo(harness, 0.5))
    monkeypatch.setattr(surgeon.commands.progress, "HEARTBEAT_S", 0.1)
    monkeypatch.setattr("surgeon.cli_render.HEARTBEAT_S", 0.1)
    res = invoke("demo", "--workdir", tmp_path / "d")
    lines = res.stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("[4/8] running the model on vLLM"))
    nxt = next(i for i, line in enumerate(lines) if line.startswith("[5/8]"))
    beats = [line for line in lines[at + 1:nxt] if "still at step 4/8" in line]
    assert len(beats) >= 3 and beats[-1].rstrip().endswith(" s"), lines  # the elapsed time, while it runs


def test_the_demo_step_shows_a_spinner_with_elapsed_time_on_a_terminal():
    from surgeon.cli_render import demo_display

    buf = io.StringIO()
    with demo_display(False, time.perf_counter(), console=Console(file=buf, force_terminal=True, width=120)) as (step, note):
        step("running the model on vLLM (starting the engine takes a while on a CPU)")
        time.sleep(0.3)
    text = buf.getvalue()
    assert "[1/8] running the model on vLLM" in text and "0:00:00" in text


@pytest.mark.parametrize("verb", ["match", "verify"])
def test_match_and_verify_report_progress(verb, harness, monkeypatch):
    from surgeon import commands

    labels: list[str] = []

    class Recorder:
        def spinner(self, label):
            import contextlib

            labels.append(label)
            return contextlib.nullcontext()

        def bar(self, label):
            raise AssertionError("no bar here")

    args = dict(subject=str(harness / "dump.safetensors"), ref=str(harness / "ref.safetensors"), progress=Recorder())
    if verb == "verify":
        args["spec"] = str(DEMO)
    getattr(commands, verb)(**args)
    assert labels == ["identifying each slot against the reference"]
