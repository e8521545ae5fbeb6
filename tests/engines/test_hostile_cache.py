"""Caches that cannot lie and engine sources that cannot hang (issue 36, items 1 and 2).

The probe cache (``$XDG_CACHE_HOME/surgeon``) decides the ids ``render`` prints: an edited entry
(every id rule's offset +1, its digest recomputed or not), an entry copied in without this user's
secret, an entry of another key, a FIFO, a link to ``/dev/zero`` or to a file of the user's, a huge
file, a cache directory others may write: none is believed, none hangs, nothing outside is
written, and each is said once on stderr. The draft-fixtures cache the same. A FIFO, a device
link, a directory or a huge file named ``*.py`` among an engine's model, runner or metadata files
is one unreadable file, never a hang.

Everything runs on the real engines (the installed SGLang, copies of it) and on real entries
written by a real probe; every run that a regression could hang is a subprocess with a timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from surgeon.engines.probes import cache
from surgeon.engines.source.locate import layout_of, locate_engine

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "specs/llama-3.1-8b-eagle3.yaml"
HUGE = (64 << 20) + 1  # over the entry limit (a sparse file: nothing is written to disk)


def xdg_env(base: Path) -> dict[str, str]:
    return dict(os.environ, XDG_CACHE_HOME=str(base / "cache"), XDG_STATE_HOME=str(base / "state"),
                PYTHONPATH=str(REPO))


def child(code: str, env: dict[str, str], *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """``python -c code args`` with a timeout: a regression that hangs fails the test instead."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=REPO)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def notes(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("surgeon: note: ")]


# -- a real entry, written once by a real probe of the installed SGLang ------------------------------
@pytest.fixture(scope="module")
def sealed(tmp_path_factory) -> dict:
    """A cache and state directory holding the entry a probe of the installed SGLang wrote: its
    key, its path relative to the base, the probe, and the model files' index (to recompute keys)."""
    from surgeon.engines.probes.probe import probe_engine, support_files
    from surgeon.engines.source.index import SourceIndex

    base = tmp_path_factory.mktemp("sealed")
    env = xdg_env(base)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
        mp.setenv("XDG_STATE_HOME", env["XDG_STATE_HOME"])
        mp.delenv("SURGEON_NO_CACHE", raising=False)
        probe = probe_engine("sglang", cache=True)
    (entry,) = (base / "cache" / "surgeon").glob("probe-*.json")
    loc = locate_engine("sglang")
    index = SourceIndex(loc.root, "sglang", loc.models_dirs)
    key = cache.key("sglang", index, "all", support_files(index, layout_of("sglang").support_dirs))
    assert entry.name == f"probe-{key}.json"
    return {"base": base, "key": key, "probe": probe, "index": index}


@pytest.fixture
def home(sealed, tmp_path, monkeypatch) -> Path:
    """A private copy of the sealed cache and state, in this process's environment too."""
    base = tmp_path / "home"
    for d in ("cache", "state"):
        shutil.copytree(sealed["base"] / d, base / d, symlinks=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(base / "cache"))
    monkeypatch.setenv("XDG_STATE_HOME", str(base / "state"))
    monkeypatch.setattr(cache, "_noted", set())
    return base


def entry_of(home: Path, key: str) -> Path:
    return home / "cache" / "surgeon" / f"probe-{key}.json"


def poison(entry: Path, *, digest: bool) -> tuple[bytes, int]:
    """Every id rule offset +1 in ``entry`` (the issue's attack), the digest recomputed when
    ``digest``; returns (the poisoned payload, the number of rules edited)."""
    sealed_entry = json.loads(entry.read_bytes())
    payload = json.loads(sealed_entry["payload"])
    edited = 0
    for c in payload["classes"].values():
        for b in (c.get("id_rule") or {}).get("branches", ()):
            b["offset"] += 1
            edited += 1
    text = json.dumps(payload)
    sealed_entry["payload"] = text
    if digest:
        sealed_entry["sha256"] = hashlib.sha256(text.encode()).hexdigest()
    entry.write_text(json.dumps(sealed_entry))
    return text.encode(), edited


# -- the probe cache: edited, copied, misplaced entries ------------------------------------------------
@pytest.mark.slow  # end to end: the CLI recomputes a whole probe
def test_render_does_not_believe_an_edited_entry(sealed, home):
    """The issue's attack end to end: offsets +1 with the digest recomputed; render's ids stay the
    probe's, one note names the entry, and the entry is recomputed and sealed again."""
    from click.testing import CliRunner

    from surgeon.cli import main
    from surgeon.engines.probes.cache import _decode

    entry = entry_of(home, sealed["key"])
    good = CliRunner().invoke(main, ["render", str(SPEC), "--engine", "sglang", "--json"])
    assert good.exit_code == 0 and not notes(good.stderr), good.stderr  # a sound entry: a silent hit
    payload, edited = poison(entry, digest=True)
    lying = _decode(json.loads(payload)).get("LlamaForCausalLM")
    assert edited > 10 and lying.capture([1, 15, 28], 32) != sealed["probe"].get("LlamaForCausalLM").capture([1, 15, 28], 32)
    r = subprocess.run([sys.executable, "-m", "surgeon", "render", str(SPEC), "--engine", "sglang", "--json"],
                       capture_output=True, text=True, timeout=180, env=xdg_env(home), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ids"] == json.loads(good.stdout)["ids"]
    (note,) = notes(r.stderr)
    assert str(entry) in note and "not signed with your cache secret" in note and "recomputed" in note
    assert cache.load(sealed["key"]).classes == sealed["probe"].classes  # re-sealed with the true answer


@pytest.mark.parametrize("attack", ["edited", "digest recomputed", "another key's entry", "copied without the secret",
                                    "damaged", "old format"])
def test_an_entry_that_cannot_be_vouched_for_is_a_miss_with_a_note(sealed, home, attack, capsys):
    key = sealed["key"]
    entry = entry_of(home, key)
    if attack == "edited":
        poison(entry, digest=False)
    elif attack == "digest recomputed":
        poison(entry, digest=True)
    elif attack == "another key's entry":
        key = "0" * 40
        entry.rename(entry_of(home, key))
        entry = entry_of(home, key)
    elif attack == "copied without the secret":
        (home / "state" / "surgeon" / cache.SECRET_NAME).unlink()
    elif attack == "damaged":
        entry.write_bytes(entry.read_bytes()[:-100])
    else:
        entry.write_text(json.dumps({**json.loads(entry.read_bytes()), "format": 3}))
    assert cache.load(key, sealed["index"]) is None
    assert cache.load(key, sealed["index"]) is None
    err = capsys.readouterr().err
    assert len(notes(err)) == 1 and str(entry) in err, err  # said once, naming the entry
    cache.store(key, sealed["probe"])  # the recomputed probe replaces it, sealed again
    assert cache.load(key, sealed["index"]).classes == sealed["probe"].classes


def test_a_sound_entry_is_believed_silently(sealed, home, capsys):
    assert cache.load(sealed["key"], sealed["index"]).classes == sealed["probe"].classes
    assert capsys.readouterr().err == ""


# -- the probe cache: what is at the entry's name ------------------------------------------------------
HOSTILE_ENTRY = """
import json, os, sys, time
from surgeon.engines.probes import cache
key, kind, victim = sys.argv[1:4]
d = cache.directory()
entry = d / f"probe-{key}.json"
probe = cache.load(key)
assert probe is not None
entry.unlink()
if kind == "fifo":
    os.mkfifo(entry)
elif kind == "link to /dev/zero":
    os.symlink("/dev/zero", entry)
elif kind == "link to a user file":
    os.symlink(victim, entry)
elif kind == "huge":
    with open(entry, "wb") as f:
        f.truncate(int(sys.argv[4]))
else:
    os.mkdir(entry)
t = time.monotonic()
miss = cache.load(key)
took = time.monotonic() - t
if kind == "directory":
    cache.store(key, probe)  # a directory there is not replaced (nor an error): no entry
    assert entry.is_dir()
    os.rmdir(entry)
cache.store(key, probe)
print(json.dumps({"miss": miss is None, "took": took, "regular": entry.is_file() and not entry.is_symlink(),
                  "hit": cache.load(key) is not None}))
"""


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "link to a user file", "huge", "directory"])
def test_an_entry_that_is_not_a_small_regular_file_is_never_read(sealed, home, kind, tmp_path):
    victim = tmp_path / "bashrc"
    victim.write_text("precious\n")
    r = child(HOSTILE_ENTRY, xdg_env(home), sealed["key"], kind, str(victim), str(HUGE), timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got == {"miss": True, "took": got["took"], "regular": True, "hit": True} and got["took"] < 5, got
    (note,) = notes(r.stderr)
    assert str(entry_of(home, sealed["key"])) in note
    assert victim.read_text() == "precious\n"


# -- the probe cache: directories and the secret -------------------------------------------------------
def test_a_cache_directory_others_may_write_is_not_used(sealed, home, capsys):
    d = home / "cache" / "surgeon"
    d.chmod(0o775)
    before = sorted(os.listdir(d))
    assert cache.load(sealed["key"]) is None  # a sound entry, but in a directory others could have written
    cache.store("1" * 40, sealed["probe"])
    cache.store("2" * 40, sealed["probe"])
    assert sorted(os.listdir(d)) == before
    (note,) = notes(capsys.readouterr().err)  # said once
    assert "writable by group or others" in note and str(d) in note


def test_a_cache_directory_that_is_a_link_is_not_used(sealed, home, tmp_path, capsys):
    d = home / "cache" / "surgeon"
    elsewhere = tmp_path / "elsewhere"
    d.rename(elsewhere)
    d.symlink_to(elsewhere)
    before = sorted(os.listdir(elsewhere))
    assert cache.load(sealed["key"]) is None
    cache.store("1" * 40, sealed["probe"])
    assert sorted(os.listdir(elsewhere)) == before
    assert "symbolic link" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_cache_directory_of_another_user_is_not_used(sealed, home, capsys):
    d = home / "cache" / "surgeon"
    os.chown(d, 65534, 65534)
    assert cache.load(sealed["key"]) is None
    assert "owned by uid 65534" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["readable by others", "link to a user file", "too short"])
def test_a_secret_that_cannot_be_believed_is_replaced_not_used(sealed, home, kind, tmp_path, capsys):
    secret = home / "state" / "surgeon" / cache.SECRET_NAME
    victim = tmp_path / "victim"
    victim.write_bytes(secret.read_bytes())  # even a link to the right bytes is not believed
    if kind == "readable by others":
        secret.chmod(0o644)
    elif kind == "link to a user file":
        secret.unlink()
        secret.symlink_to(victim)
    else:
        secret.write_bytes(b"short")
    old = victim.read_bytes()
    assert cache.load(sealed["key"]) is None
    cache.store(sealed["key"], sealed["probe"])
    assert secret.is_file() and not secret.is_symlink() and (secret.stat().st_mode & 0o777) == 0o600
    assert secret.read_bytes() != old and victim.read_bytes() == old
    assert cache.load(sealed["key"]).classes == sealed["probe"].classes
    assert "replacing it" in capsys.readouterr().err


def test_the_key_is_what_the_entry_was_computed_from(sealed, engine_copy):
    """A copy of the engine has the same key (its content is the same); an edited model file, or a
    FIFO added among them, is another key; and the entry names its key inside the sealed part."""
    from surgeon.engines.source.index import SourceIndex

    root = engine_copy("sglang")
    key = cache.key("sglang", SourceIndex(root, "sglang", ("srt/models",)), "all")
    assert key == cache.key("sglang", SourceIndex(root, "sglang", ("srt/models",)), "all")
    with open(root / "srt/models/llama.py", "a") as f:
        f.write("# edited\n")
    edited = cache.key("sglang", SourceIndex(root, "sglang", ("srt/models",)), "all")
    os.mkfifo(root / "srt/models/zz_fifo.py")
    assert len({key, edited, cache.key("sglang", SourceIndex(root, "sglang", ("srt/models",)), "all")}) == 3
    assert json.loads((sealed["base"] / "cache" / "surgeon" / f"probe-{sealed['key']}.json").read_bytes())["key"] == sealed["key"]


# -- engine sources: FIFOs, devices and huge files named *.py ------------------------------------------
def plant(folder: Path, victim: Path) -> dict[str, str]:
    """A FIFO, a link to /dev/zero, a directory and a huge sparse file named ``*.py`` in ``folder``."""
    os.mkfifo(folder / "zz_fifo.py")
    (folder / "zz_zero.py").symlink_to("/dev/zero")
    (folder / "zz_dir.py").mkdir()
    with open(folder / "zz_huge.py", "wb") as f:
        f.truncate((16 << 20) + 1)
    (folder / "zz_victim.py").symlink_to(victim)  # a link to a regular file is read (site-packages use links)
    return {"zz_fifo.py": "FIFO", "zz_zero.py": "character device", "zz_dir.py": "directory", "zz_huge.py": "limit"}


INDEX = """
import json, sys
from pathlib import Path
from surgeon.engines.source.index import SourceIndex
index = SourceIndex(Path(sys.argv[1]), "sglang", ("srt/models",))
print(json.dumps({"files": index.model_files, "texts": {p: index.text(p) is not None for p in index.model_files},
                  "refused": index.refused, "fingerprint": index.fingerprint(index.model_files)}))
"""


def test_model_files_that_are_not_regular_files_are_refused_at_once(engine_copy, tmp_path):
    root = engine_copy("sglang")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    clean = json.loads(child(INDEX, env, str(root)).stdout)
    victim = tmp_path / "victim.py"
    victim.write_text("class Victim:\n    pass\n")
    kinds = plant(root / "srt" / "models", victim)
    got = json.loads(child(INDEX, env, str(root), timeout=60).stdout)
    for name, why in kinds.items():
        rel = f"srt/models/{name}"
        assert rel in got["files"] and not got["texts"][rel] and why in got["refused"][rel], (rel, got["refused"])
    assert got["texts"]["srt/models/zz_victim.py"] and "srt/models/zz_victim.py" not in got["refused"]
    assert set(got["refused"]) == {f"srt/models/{n}" for n in kinds}
    assert all(got["texts"][p] for p in clean["files"])  # every other file read as before
    assert got["fingerprint"] != clean["fingerprint"]


@pytest.mark.slow  # end to end: the CLI recomputes a whole probe
def test_render_with_a_fifo_among_the_model_files(engine_copy, home):
    """A FIFO named ``*.py`` in the models folder hung render: now its answer is the same as
    without it (the installed engine's, from the cache), and it does not wait on the FIFO."""
    root = engine_copy("sglang")
    env = xdg_env(home)
    os.mkfifo(root / "srt" / "models" / "zz_fifo.py")
    render = [sys.executable, "-m", "surgeon", "render", str(SPEC), "--engine", "sglang", "--json"]
    r = subprocess.run([*render, "--engine-root", str(root)], capture_output=True, text=True, timeout=180, env=env)
    base = subprocess.run(render, capture_output=True, text=True, timeout=180, env=env)  # the installed one, cached
    assert r.returncode == 0 and base.returncode == 0, (r.stderr, base.stderr)
    assert json.loads(r.stdout)["ids"] == json.loads(base.stdout)["ids"]


COVERAGE = """
import json, os, sys
from pathlib import Path
from surgeon.patch import coverage
from surgeon.patch.recipes import load_recipes
root = Path(sys.argv[1])
llama = root / "srt/models/llama.py"
nfiles, tasks, unparsed = coverage._prefilter("sglang", root, ("srt/models",), load_recipes())
(task,) = [t for t in tasks if t[2] == "srt/models/llama.py"]
os.rename(llama, str(llama) + ".orig")
os.mkfifo(llama)  # swapped in after the prefilter read it: the worker must not wait on it either
print(json.dumps({"unparsed": {u[0]: u[1] for u in unparsed},
                  "worker": [c.reason for c in coverage._file_task(task)]}))
"""


def test_coverage_counts_a_fifo_as_unreadable(engine_copy):
    """Coverage hung on a FIFO named ``*.py``: the prefilter and the worker each refuse it at once
    and say why, and the other files are counted as before."""
    root = engine_copy("sglang")
    os.mkfifo(root / "srt" / "models" / "zz_fifo.py")
    r = child(COVERAGE, dict(os.environ, PYTHONPATH=str(REPO)), str(root), timeout=120)
    got = json.loads(r.stdout)
    assert list(got["unparsed"]) == ["srt/models/zz_fifo.py"] and "FIFO" in got["unparsed"]["srt/models/zz_fifo.py"]
    assert got["worker"] and all("FIFO" in why for why in got["worker"]), got["worker"]


RUNNER = """
import json, sys
from pathlib import Path
from surgeon.engines.probes.runner import RunnerReader
from surgeon.engines.probes.vllm_runners import choice_where, source_line
from surgeon.engines.source.locate import locate_engine
reader = RunnerReader(sys.argv[1], Path(sys.argv[2]))
model = reader.read("x")
print(json.dumps({"calls": [[c.path, c.line, c.function, str(c.passes)] for c in model.calls],
                  "fifo_text": reader.text(sys.argv[3]), "line": source_line(Path(sys.argv[2]), sys.argv[3], "x", "p")}))
"""


def mirror(src: Path, dest: Path) -> None:
    """``dest`` a tree of links to ``src``'s files (no bytes copied; the engine is never written)."""
    for top, _, names in os.walk(src):
        out = dest / Path(top).relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        for n in names:
            (out / n).symlink_to(Path(top) / n)


def test_runner_files_that_are_fifos_are_skipped(tmp_path):
    from surgeon.engines.probes.runner import RUNNER_DIRS

    installed = locate_engine("sglang").root
    root = tmp_path / "sglang"
    for d in RUNNER_DIRS["sglang"]:
        if (installed / d).is_dir():
            mirror(installed / d, root / d)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    fifo = "srt/model_executor/zz_fifo.py"
    clean = json.loads(child(RUNNER, env, "sglang", str(root), fifo).stdout)
    os.mkfifo(root / fifo)
    (root / "srt/speculative/zz_zero.py").symlink_to("/dev/zero")
    got = json.loads(child(RUNNER, env, "sglang", str(root), fifo, timeout=60).stdout)
    assert got["calls"] == clean["calls"] and got["calls"]  # the same setter calls, read as before
    assert got["fifo_text"] is None and got["line"] is None


LOCATE = """
import sys
from surgeon.engines.source.locate import locate_engine
print(locate_engine("sglang", sys.argv[1]).version)
"""


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "huge"])
def test_a_metadata_file_that_is_not_regular_gives_no_version_not_a_hang(engine_copy, kind):
    root = engine_copy("sglang")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    version = child(LOCATE, env, str(root)).stdout.strip()
    assert version != "unknown"
    for info in root.parent.glob("*.dist-info"):
        for name in ("METADATA", "RECORD"):
            (info / name).unlink()
            if kind == "fifo":
                os.mkfifo(info / name)
            elif kind == "huge":
                with open(info / name, "wb") as f:
                    f.truncate((16 << 20) + 1)
            else:
                (info / name).symlink_to("/dev/zero")
    r = child(LOCATE, env, str(root), timeout=60)
    assert r.returncode == 0, r.stderr
    # the version then comes from the folder's name (sglang-0.5.23.dist-info), as for a METADATA without one
    assert r.stdout.strip() == version


# -- the draft-fixtures cache -----------------------------------------------------------------------
FIXTURES = """
import json, os, shutil, sys
from pathlib import Path
from surgeon.draft import synthetic
from surgeon.engines.probes import cache
base = Path(sys.argv[1])
calls = []
def build(out):
    calls.append(1)
    (out / "model.safetensors").write_bytes(b"weights")
    (out / "sub").mkdir()
    (out / "sub" / "config.json").write_text("{}")
def attack(first, how, victim):
    if how == "edited":
        (first / "model.safetensors").write_bytes(b"evil")
    elif how == "planted link":
        (first / "extra.json").symlink_to(victim)
    elif how == "fifo":
        (first / "sub" / "config.json").unlink()
        os.mkfifo(first / "sub" / "config.json")
    elif how == "folder is a link":
        shutil.copytree(first, victim.with_suffix(".d"))
        shutil.rmtree(first)
        first.symlink_to(victim.with_suffix(".d"))
    elif how == "untrusted":
        synthetic.cache_root().chmod(0o777)
out = {}
for how in sys.argv[2:]:
    os.environ.update(XDG_CACHE_HOME=str(base / how / "cache"), XDG_STATE_HOME=str(base / how / "state"))
    calls.clear()
    cache._noted.clear()
    victim = base / how / "victim"
    victim.parent.mkdir(parents=True)
    victim.write_text("precious")
    first = synthetic._cached("t", {"x": 1}, build)
    attack(first, how, victim)
    sys.stderr.write(f"== {how}\\n")
    again = synthetic._cached("t", {"x": 1}, build)
    synthetic._cached("t", {"x": 1}, build)
    out[how] = {"builds": len(calls), "same": again == first, "weights": (again / "model.safetensors").read_bytes().decode(),
                "cached": str(again).startswith(str(synthetic.cache_root())), "victim": victim.read_text(),
                "files": sorted(os.listdir(synthetic.cache_root()))}
print(json.dumps(out))
"""
ATTACKS = ["none", "edited", "planted link", "fifo", "folder is a link", "untrusted"]


def test_the_draft_fixtures_cache_reuses_only_what_its_manifest_vouches_for(tmp_path):
    """A fixture folder (trained weights a test or the demo reuses) is reused only while its
    sealed manifest vouches for every file; an edited file, a planted link, a FIFO, the folder
    swapped for a link: rebuilt once with a note, nothing outside touched. In a directory others
    may write, nothing is cached (built in a private folder each time), said once."""
    r = child(FIXTURES, xdg_env(tmp_path), str(tmp_path), *ATTACKS, timeout=180)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    said = dict(zip(ATTACKS, r.stderr.split("== ")[1:]))
    for attack, row in got.items():
        assert row["weights"] == "weights" and row["victim"] == "precious", (attack, row)
        if attack == "none":
            assert row["builds"] == 1 and row["same"] and not notes(said[attack]), (attack, row)
        elif attack == "untrusted":  # built outside the cache, each time, said once
            assert row["builds"] == 3 and not row["cached"] and len(row["files"]) == 1, (attack, row)
            (note,) = notes(said[attack])
            assert "writable by group or others" in note
        else:  # rebuilt once, then reused; the damaged folder is gone
            assert row["builds"] == 2 and row["same"] and row["cached"] and len(row["files"]) == 1, (attack, row)
            (note,) = notes(said[attack])
            assert "set aside and built again" in note, note
    assert sorted(os.listdir(tmp_path / "folder is a link" / "victim.d"))  # the link's target is left alone
