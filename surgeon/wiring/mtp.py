"""The MTP / NextN input point: the spec's ``draft.mtp_input`` against the state each engine hands
its MTP head (read by :mod:`surgeon.engines.facts.mtp_input`)."""

from __future__ import annotations

from surgeon.core.spec import Spec
from surgeon.engines.source.locate import ProbeError, locate_engine

Line = tuple[str, str, str]  # (severity, kind, detail)


def mtp_lines(spec: Spec, engine: str, engine_root=None) -> list[Line]:
    """Per engine: what it hands the MTP head (file:line); an error where that is not the spec's
    ``draft.mtp_input`` or where the engine builds no MTP head for the target; a warning where the
    spec does not declare it or the engine's answer is not decided by what was read."""
    if spec.model.draft is None or spec.model.draft.kind != "mtp" or engine not in ("sglang", "vllm"):
        return []
    try:
        loc = locate_engine(engine, engine_root)
    except ProbeError as e:
        return [("warning", "mtp_unchecked", f"{engine}: {e}; the MTP input is read from its source only")]
    from surgeon.engines.facts.mtp_input import read_mtp_input  # libcst: only once an engine is there to read

    ans = read_mtp_input(loc, spec.model.target.architecture)
    where = "; ".join(ans.evidence)
    got = ans.point(spec.num_layers)
    want = spec.mtp_input
    if ans.no_head:
        return [("error", "mtp_no_head", f"{engine} {ans.version} has no MTP head for {spec.model.target.architecture}: "
                 f"{where}; an MTP draft of this target is not served by {engine} {ans.version}")]
    if got is None:
        return [("warning", "mtp_unverified", f"{engine} {ans.version}: what it hands the MTP head is not decided: {ans.reason}")]
    if want is None:
        return [("warning", "mtp_undeclared", f"{engine} {ans.version} hands the MTP head {got} ({where}); the spec does "
                 "not declare draft.mtp_input, so the head's training input is not checked")]
    if str(want) != got:
        return [("error", "mtp_input", f"the MTP head was trained on {want} (spec draft.mtp_input), but {engine} "
                 f"{ans.version} hands it {got}: {where}; the draft is served wrong, silently")]
    return [("info", "mtp_input", f"{engine} {ans.version} hands the MTP head {got}, as the spec says: {where}")]
