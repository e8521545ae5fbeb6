"""Where an audit's identity profile comes from (``--reference``):

* ``hf:MODEL``: the target run here (:func:`surgeon.verify.reference.capture_reference`) on the
  input ids of the first :data:`PROMPTS` readable files of the set, once; the model also serves
  the exact identification of a sample of files, each on its own tokens;
* a reference file (``surgeon reference``) or an engine's sweep dump: its states;
* a fingerprint: its stored per-token norms.

A profile of a target with another number of layers than the spec's is bad input.
"""

from __future__ import annotations

from pathlib import Path

from surgeon.audit.profile import Profile, profile_from_norms, profile_from_states
from surgeon.core.errors import BadInput

PROMPTS = 12


def _prompt_ids(paths: list[str], num_layers: int) -> list:
    from surgeon.verify.subjects import read_subject

    out = []
    for p in paths:
        try:
            ids = read_subject(p, num_layers=num_layers).input_ids
        except BadInput:
            continue
        if ids is not None and ids.numel() >= 2:
            out.append(ids)
        if len(out) == PROMPTS:
            break
    if not out:
        raise BadInput("--reference hf:...: no file of the set carries input ids to run the target on")
    return out


def build_profile(reference: str | None, spec, paths: list[str], notes: list[str]) -> tuple[Profile | None, str | None]:
    """(profile, model folder for exact identification or None)."""
    if reference is None:
        return None, None
    if reference.startswith("hf:"):
        from surgeon.verify.reference import capture_reference, resolve_model

        model_dir, label = resolve_model(reference[3:])
        refs = [capture_reference(model_dir, ids) for ids in _prompt_ids(paths, spec.num_layers)]
        _check_layers(refs[0].num_layers, spec)
        notes.append(f"identity profile: {label} run on the input ids of {len(refs)} files of the set")
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
