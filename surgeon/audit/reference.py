"""Where an audit's identity profile comes from (``--reference``):

* ``hf:MODEL``: the target run here (:func:`surgeon.verify.reference.capture_reference`) on the
  input ids of :data:`PROMPTS` files of the set, once: the longest file of each of :data:`PROMPTS`
  runs of files spread over the set (a set sorted by length or by source is sampled whole, not at
  its start), at most :data:`PROFILE_TOKENS` of each (a causal model's states on a prefix are
  exact): the profile's ladder of sample lengths is measured on their prefixes
  (:mod:`surgeon.audit.profile`), so long prompts give every rung; a resumed audit takes the files its state names, so that its
  profile is the one recorded whatever was added to the set since; a file the target cannot run
  (a token out of its vocabulary) is left out, and said so, where a model the audit cannot use
  stops it at once; the model also serves the exact identification of a sample of files, each on
  its own tokens;
* a reference file (``surgeon reference``) or an engine's sweep dump: its states;
* a fingerprint: its stored per-token norms.

A profile of a target with another number of layers or another hidden size than the spec's is bad input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

from surgeon.audit.profile import Profile, profile_from_norms, profile_from_states
from surgeon.core.errors import BadInput

PROMPTS = 12
CANDIDATES = 8 * PROMPTS  # files whose headers are read to pick the prompts from
PROFILE_TOKENS = 2048  # the target runs on at most this many tokens of a prompt (its memory: every point's states)


def _spread(items: list, k: int) -> list:
    """``k`` of ``items`` evenly spaced (all of them if there are no more)."""
    n = len(items)
    return items if n <= k else [items[(i * n) // k] for i in range(k)]


def _with_ids(paths: list[str]) -> list[tuple[str, int]]:
    """(path, tokens) of up to :data:`CANDIDATES` files spread over the set whose header says they
    carry input ids for 2 tokens or more, in the set's order."""
    from surgeon.audit.structure import read_structure

    out = []
    for p in _spread(paths, CANDIDATES):
        try:
            st = read_structure(p)
        except BadInput:
            continue
        if st.ids and st.tokens and st.tokens >= 2:
            out.append((p, int(st.tokens)))
    return out


def prompt_files(paths: list[str], prefer: Sequence[str] = ()) -> Iterator[str]:
    """The files in the order the target is run on them until :data:`PROMPTS` ran: ``prefer`` alone
    where given (a resumed audit's, from its state: the profile it recorded), else the longest
    candidate of each of :data:`PROMPTS` runs of consecutive candidates (the first of equals), then
    the other candidates, longest first."""
    if prefer:
        yield from prefer
        return
    found = _with_ids(paths)
    n, k = len(found), min(len(found), PROMPTS)
    runs = [found[(i * n) // k:((i + 1) * n) // k] for i in range(k)]  # none empty: n >= k
    first = [max(run, key=lambda f: f[1])[0] for run in runs]
    yield from first
    taken = set(first)
    yield from (p for p, _ in sorted(found, key=lambda f: -f[1]) if p not in taken)


def _captured(model_dir: str | Path, paths: list[str], num_layers: int, notes: list[str],
              prefer: Sequence[str]) -> tuple[list, list[str]]:
    """The target's states on each picked file's input ids, and those files (a file that cannot be
    read or holds a token out of the target's vocabulary is left out, noted; any other error is the
    model's, and stops the build)."""
    from surgeon.verify.reference import OutOfVocabulary, capture_reference
    from surgeon.verify.subjects import read_subject

    refs: list = []
    used: list[str] = []
    skipped: list[str] = []
    for p in prompt_files(paths, prefer):
        if len(refs) == PROMPTS:
            break
        try:
            ids = read_subject(p, num_layers=num_layers).input_ids
        except BadInput as e:  # the file's fault
            skipped.append(f"{p} ({(str(e).splitlines() or [''])[0]})")
            continue
        if ids is None or ids.numel() < 2:
            continue
        try:
            refs.append(capture_reference(model_dir, ids.reshape(-1)[:PROFILE_TOKENS]))
        except OutOfVocabulary as e:  # the ids' fault; any other is the model's, the same for every file
            skipped.append(f"{p} ({e})")
            continue
        used.append(p)
    if skipped:
        notes.append(f"identity profile: {len(skipped)} file(s) left out, the target could not run them: "
                     + "; ".join(skipped[:3]) + (" ..." if len(skipped) > 3 else ""))
    if not refs:
        raise BadInput("--reference hf:...: no file of the set carries input ids the target can run"
                       + (f" ({skipped[0]})" if skipped else ""))
    return refs, used


def build_profile(reference: str | None, spec, paths: list[str], notes: list[str],
                  prefer: Sequence[str] = ()) -> tuple[Profile | None, str | None]:
    """(profile, model folder for exact identification or None). ``prefer``: for ``hf:``, the files
    to run the target on, and no others (a resumed audit's, from its state)."""
    if reference is None:
        return None, None
    if reference.startswith("hf:"):
        from surgeon.verify.reference import resolve_model

        model_dir, label = resolve_model(reference[3:])
        refs, used = _captured(model_dir, paths, spec.num_layers, notes, prefer)
        _check_target(refs[0], spec)
        n = [int(r.input_ids.numel()) for r in refs]
        notes.append(f"identity profile: {label} run on the input ids of {len(refs)} files spread over the set "
                     f"({min(n)}-{max(n)} tokens" + (f", at most {PROFILE_TOKENS} of each" if max(n) == PROFILE_TOKENS else "")
                     + ")")
        profile = profile_from_states([r.states for r in refs], spec.num_layers, label, [int(r.input_ids[0]) for r in refs])
        return dataclasses.replace(profile, files=tuple(used)), str(Path(model_dir).resolve())
    from surgeon.verify.fingerprint import Fingerprint
    from surgeon.verify.harness import load_reference_arg

    ref = load_reference_arg(reference, None)
    _check_target(ref, spec)
    notes.append(f"identity profile: {reference} (one prompt, {ref.input_ids.numel()} tokens)")
    if isinstance(ref, Fingerprint):
        return profile_from_norms([ref.norms], spec.num_layers, reference), None
    return profile_from_states([ref.states], spec.num_layers, reference, [int(ref.input_ids.reshape(-1)[0])]), None


def _check_target(ref, spec) -> None:
    """A reference of another model than the spec's target (its layers or its width) is bad input."""
    if ref.num_layers != spec.num_layers:
        raise BadInput(f"--reference: a {ref.num_layers}-layer target, the spec {spec.name} declares {spec.num_layers}")
    if ref.hidden_size != spec.hidden_size:
        raise BadInput(f"--reference: a target of hidden size {ref.hidden_size}, the spec {spec.name} declares "
                       f"{spec.hidden_size}")
