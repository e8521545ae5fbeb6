"""Validated reading of the manifest and journal, and the patch markers: property tests.

Whatever bytes a state file holds, reading it either gives a manifest every later step can use
as it is (paths relative and inside the root, hashes hex sha256) or one PatchError naming the
file; a marker survives its own text and nothing but a validated marker is ever built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from surgeon.core.atomicfile import ABSENT
from surgeon.patch.markers import Marker, find_markers, hooks_relpath
from surgeon.patch.statedir import PatchError
from surgeon.patch.statefiles import SHA_RE, check_relpath, parse_journal, parse_manifest

PATH = Path("/root/.surgeon/manifest.json")
SHA = "ab" * 32

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20)


def _good_manifest() -> dict:
    return {"format": 1, "txid": None, "id": "0123456789abcdef", "patches": {"p1": {
        "name": "p1", "spec": {"name": "s", "sha256": SHA}, "engine": {"name": "vllm", "version": "0.32.0"},
        "created": "now", "files": [{"relpath": "model_executor/models/llama.py", "sha256_before": SHA,
                                     "sha256_after": "cd" * 32},
                                    {"relpath": "model_executor/models/_h.py", "sha256_before": ABSENT,
                                     "sha256_after": "ef" * 32}]}}}


def _usable(m: dict) -> None:
    """What every consumer of a parsed manifest relies on."""
    for name, p in m["patches"].items():
        assert p["name"] == name
        for f in p["files"]:
            check_relpath(f["relpath"])
            assert SHA_RE.fullmatch(f["sha256_after"]) and (f["sha256_before"] == ABSENT
                                                            or SHA_RE.fullmatch(f["sha256_before"]))


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_a_manifest_or_one_error_naming_the_file(data: bytes):
    try:
        _usable(parse_manifest(PATH, data))
    except PatchError as e:
        assert str(e).startswith(str(PATH)) and "\n" not in str(e)


@settings(max_examples=150, deadline=None)
@given(json_values)
def test_any_json_is_a_manifest_or_one_error_naming_the_file(value):
    try:
        _usable(parse_manifest(PATH, json.dumps(value).encode()))
    except PatchError as e:
        assert str(e).startswith(str(PATH)) and "\n" not in str(e)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["format", "txid", "id", "patches", "name", "spec", "engine", "created", "files",
                        "relpath", "sha256_before", "sha256_after", "sha256", "version"]), json_values)
def test_one_damaged_field_of_a_good_manifest_is_refused_or_harmless(key: str, value):
    """Replace every occurrence of one key's value in a good manifest by anything."""
    def damage(node):
        if isinstance(node, dict):
            return {k: (value if k == key else damage(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [damage(v) for v in node]
        return node

    m = damage(_good_manifest())
    try:
        _usable(parse_manifest(PATH, json.dumps(m).encode()))
    except PatchError as e:
        assert str(e).startswith(str(PATH))


@pytest.mark.parametrize("bad, why", [
    ({"format": 1}, "missing 'patches'"),
    ({"format": 1, "patches": []}, "patches: wrong type list"),
    ({"format": 1, "patches": {"x": {}}}, "missing 'name'"),
    ({"format": 2, "patches": {}}, "this surgeon reads format 1"),
])
def test_each_damage_says_what_is_wrong(bad, why):
    with pytest.raises(PatchError, match=why):
        parse_manifest(PATH, json.dumps(bad).encode())


def test_hashes_and_paths_that_would_escape_are_refused():
    for field, value, why in (("sha256_before", "../..", "is not a sha256"),
                              ("relpath", "../../etc/passwd", "must not contain '..'"),
                              ("relpath", "/etc/passwd", "absolute path"),
                              ("relpath", ".surgeon/manifest.json", "inside surgeon's own state directory")):
        m = _good_manifest()
        m["patches"]["p1"]["files"][0][field] = value
        with pytest.raises(PatchError, match=why):
            parse_manifest(PATH, json.dumps(m).encode())


def test_a_journal_of_only_a_format_is_refused():
    with pytest.raises(PatchError, match="journal: missing 'txid'"):
        parse_journal(PATH.with_name("journal.json"), b'{"format": 1}')


names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}", fullmatch=True)
shas = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)
ids = st.from_regex(r"[0-9a-f]{16}", fullmatch=True)


@settings(max_examples=100, deadline=None)
@given(names, shas, ids, shas, st.text(max_size=40))
def test_a_marker_is_found_again_in_any_file(name, spec, mid, orig, around):
    mk = Marker(name, spec, mid, orig)
    source = f"import os\n{around.replace(chr(13), '')}\n{mk.text()}\nimport x\n".encode()
    assert mk in find_markers(source)
    assert hooks_relpath("a/b/llama.py", name).startswith("a/b/_surgeon_hooks_")


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=60), shas, ids, shas)
def test_no_marker_is_built_from_anything_but_a_patch_name(name, spec, mid, orig):
    """A name with a space, newline or '#' never becomes marker (comment) text."""
    try:
        mk = Marker(name, spec, mid, orig)
    except ValueError:
        return
    assert "\n" not in mk.text() and mk.text().count("#") == 1 and find_markers(mk.text().encode()) == [mk]
