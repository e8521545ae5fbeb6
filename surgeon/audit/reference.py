"""Where an audit's identity profile comes from (``--reference``):

* ``hf:MODEL``: the target run here (:func:`surgeon.verify.reference.capture_reference`) on the
  input ids of :data:`PROMPTS` files of the set, once, picked across the set (a set sorted by length
  or by source is sampled whole, not at its start) among those of :data:`MIN_TOKENS` tokens or more
  where there are enough (the per-channel statistics of a short prompt lean on its first
  positions); a file the target cannot run (a token out of its vocabulary) is left out, and said
  so; the model also serves the exact identification of a sample of files, each on its own tokens;
* a reference file (``surgeon reference``) or an engine's sweep dump: its states;
* a fingerprint: its stored per-token norms.

A profile of a target with another number of layers than the spec's is bad input.
"""

from __future__ import annotations

from pathlib import Path

from surgeon.audit.profile import Profile, profile_from_norms, profile_from_states
from surgeon.core.errors import BadInput

PROMPTS = 12
MIN_TOKENS = 64  # a reference prompt's length where the set has enough such files
CANDIDATES = 8 * PROMPTS  # files looked at (their headers) to pick the prompts from


def _spread(items: list, k: int) -> list:
    """``k`` of ``items`` evenly spaced (all of them if there are no more)."""
    n = len(items)
    return items if n <= k else [items[(i * n) // k] for i in range(k)]


def _lengths(paths: list[str]) -> list[tuple[str, int]]:
    """(path, tokens) of up to :data:`CANDIDATES` files spread over the set whose header says they
    carry input ids for 2 tokens or more."""
    from surgeon.audit.structure import read_structure

    out = []
    for p in _spread(paths, CANDIDATES):
        try:
            st = read_structure(p)
        except BadInput:
            continue
        if st.ids and st.tokens and st.tokens >= 2:
            out.append((p, st.tokens))
    return out


def prompt_files(paths: list[str]) -> list[str]:
    """The candidate files in the order the target is run on them until :data:`PROMPTS` ran: first
    :data:`PROMPTS` spread over those of :data:`MIN_TOKENS` tokens or more, then the other such
    ones, then the shorter ones, longest first."""
    found = _lengths(paths)
    long = [p for p, t in found if t >= MIN_TOKENS]
    first = _spread(long, PROMPTS)
    taken = set(first)
    return first + [p for p in long if p not in taken] + [p for p, _ in sorted(
        (x for x in found if x[1] < MIN_TOKENS), key=lambda x: -x[1])]


def _captured(model_dir: str | Path, paths: list[str], num_layers: int, notes: list[str]) -> list:
    """The target's states on each picked file's input ids (a file it cannot run is left out, noted)."""
    from surgeon.verify.reference import capture_reference
    from surgeon.verify.subjects import read_subject

    refs: list = []
    skipped: list[str] = []
    for p in prompt_files(paths):
        if len(refs) == PROMPTS:
            break
        try:
            ids = read_subject(p, num_layers=num_layers).input_ids
            if ids is not None and ids.numel() >= 2:
                refs.append(capture_reference(model_dir, ids))
        except BadInput as e:
            skipped.append(f"{p} ({(str(e).splitlines() or [''])[0]})")
    if skipped:
        notes.append(f"identity profile: {len(skipped)} file(s) left out, the target could not run them: "
                     + "; ".join(skipped[:3]) + (" ..." if len(skipped) > 3 else ""))
    if not refs:
        raise BadInput("--reference hf:...: no file of the set carries input ids the target can run"
                       + (f" ({skipped[0]})" if skipped else ""))
    return refs


def build_profile(reference: str | None, spec, paths: list[str], notes: list[str]) -> tuple[Profile | None, str | None]:
    """(profile, model folder for exact identification or None)."""
    if reference is None:
        return None, None
    if reference.startswith("hf:"):
        from surgeon.verify.reference import resolve_model

        model_dir, label = resolve_model(reference[3:])
        refs = _captured(model_dir, paths, spec.num_layers, notes)
        _check_layers(refs[0].num_layers, spec)
        n = [int(r.input_ids.numel()) for r in refs]
        notes.append(f"identity profile: {label} run on the input ids of {len(refs)} files spread over the set "
                     f"({min(n)}-{max(n)} tokens)")
        return (profile_from_states([r.states for r in refs], spec.num_layers, label, [int(r.input_ids[0]) for r in refs]),
                str(Path(model_dir).resolve()))
    from surgeon.verify.fingerprint import Fingerprint
    from surgeon.verify.harness import load_reference_arg

    ref = load_reference_arg(reference, None)
    _check_layers(ref.num_layers, spec)
    notes.append(f"identity profile: {reference} (one prompt, {ref.input_ids.numel()} tokens)")
    if isinstance(ref, Fingerprint):
        return profile_from_norms([ref.norms], spec.num_layers, reference), None
    return profile_from_states([ref.states], spec.num_layers, reference, [int(ref.input_ids.reshape(-1)[0])]), None


def _check_layers(num_layers: int, spec) -> None:
    if num_layers != spec.num_layers:
        raise BadInput(f"--reference: a {num_layers}-layer target, the spec {spec.name} declares {spec.num_layers}")
