"""The native route of :mod:`surgeon.patch.routes`: the engine's own capture path, judged for a dump.

vLLM (``extract_hidden_states`` with its hidden-state connector) and SGLang
(``--enable-return-aux-hidden-states``): whether the release has the path, what its source refuses
(MLA verifiers, pipeline parallelism, a loaded draft) and endangers (prefix caching, pinned memory
on CPU), all from :mod:`surgeon.engines.probes.native`; the ids through the model class's setter the
route selects (SGLang: the setter of each ``--speculative-algorithm`` in turn); rows in the order
the engine writes them, which is what the sidecar records. TensorRT-LLM's
``SaveHiddenStatesDecodingConfig``: from the cited table.
"""

from __future__ import annotations

from collections.abc import Sequence

from surgeon.core.conventions import EngineConvention, NotExpressible
from surgeon.core.points import Point
from surgeon.core.routefacts import NativeCapture, RouteCondition
from surgeon.patch.routes.model import DUMP_DIR, TITLES, PlanInput, RoutePlan, Verdict, dumped_json, engine_launch, refused

# surgeon's subclass of vLLM's hidden-state connector for CPU builds (the stock one pins memory), loaded
# by vLLM through kv_connector_module_path.
CPU_CONNECTOR_MODULE = "surgeon.run.hs_connector"
CPU_CONNECTOR = "SurgeonHiddenStatesConnector"  # surgeon.run.extract_runner.CONNECTOR_CLASS (a test holds them equal)


def condition_text(c: RouteCondition) -> str:
    """One line: what the source does, and where (or the public thread, when not read here)."""
    where = c.cite.where if c.cite is not None else None
    if not c.read:
        return f"{c.text} ({c.thread or where}; not read from this release's source)"
    return f"{c.text} ({where})" if where else c.text


def _first_refusal(nat: NativeCapture, code: str) -> RouteCondition | None:
    return next(iter(nat.refusal(code)), None)


def _applies(c: RouteCondition, platform: str | None) -> bool:
    """Pinned memory endangers the route only on a CPU platform; every other hazard everywhere."""
    return c.code != "pin_memory" or platform == "cpu"


def engine_native(inp: PlanInput, needs: Sequence[str]) -> RoutePlan:
    """vLLM's or SGLang's native capture, judged from the release's source."""
    from surgeon.engines.probes.native import read_route_facts
    from surgeon.engines.view import open_engine

    nat = read_route_facts(inp.engine, inp.engine_root).native
    rp = RoutePlan("native", TITLES["native"], {})
    if not nat.available:
        rp.verdicts = refused(nat.reason, needs)
        return rp
    view = open_engine(inp.engine, inp.engine_root)
    platform = view.probe.platform if view.probe is not None else None
    rp.evidence = [f"{c.where}: {c.text}" for c in (nat.defined, nat.ids_read) if c is not None]
    rp.hazards = [condition_text(h) for h in nat.hazards if _applies(h, platform)]
    if "serve" in needs:
        draft = _first_refusal(nat, "draft")
        said = (f": {condition_text(draft)}" if draft else
                f" (the method replaces the draft: {nat.defined.where})" if nat.defined else "")
        rp.verdicts["serve"] = Verdict(False, "the native path captures for a dump and loads no draft" + said)
    if "dump" in needs:
        if inp.engine == "vllm":
            _vllm_dump(inp, nat, rp, view, platform)
        else:
            _sglang_dump(inp, nat, rp, view)
        if rp.verdicts["dump"].captures:
            rp.verdicts["dump"].names = [n for n, _ in _file_order(inp)]
    return rp


def _file_order(inp: PlanInput) -> list[tuple[str, Point]]:
    """The dump's (name, point) pairs in the order a stack of ascending ids holds them."""
    L = inp.spec.num_layers
    return sorted(inp.dump_points or [], key=lambda np: np[1].depth(L))


def _refusals(inp: PlanInput, nat: NativeCapture) -> str | None:
    """What the route refuses before any id is read: the final norm's output, pp > 1."""
    finals = [n for n, p in inp.dump_points or [] if p.kind == "final_norm"]
    if finals and nat.final_state is not None:
        return f"slot {finals[0]!r} is final_norm, and {condition_text(nat.final_state)}"
    pp = _first_refusal(nat, "pp")
    if inp.pp > 1 and pp is not None:
        return f"pp {inp.pp}: {condition_text(pp)}"
    return None


def _class_ids(inp: PlanInput, conv: EngineConvention, probe) -> tuple[list[int] | None, str | None]:
    """The ids that make ``conv``'s class capture the dump's points (ascending), or why none."""
    from surgeon.wiring.evidence import refusal
    from surgeon.wiring.runnercheck import runner_refusal

    L = inp.spec.num_layers
    points = [p for _, p in _file_order(inp)]
    positions = [p.position for p in points if p.position is not None]
    if why := refusal(conv.cc, positions, L):
        return None, why
    try:
        ids = conv.encode(points, L)
    except NotExpressible as e:
        return None, str(e)
    if why := runner_refusal(probe, conv.cc, ids, L):
        return None, why
    return ids, None


def _vllm_dump(inp: PlanInput, nat: NativeCapture, rp: RoutePlan, view, platform: str | None) -> None:
    from surgeon.engines.probes.native import uses_mla
    from surgeon.engines.view import model_class_for

    conv = view.convention(model_class_for(inp.spec, "vllm"))
    if why := _refusals(inp, nat):
        rp.verdicts["dump"] = Verdict(False, why)
        return
    ids, why = _class_ids(inp, conv, view.probe)
    if ids is None:
        rp.verdicts["dump"] = Verdict(False, why or "no ids")
        return
    order = [str(p) for _, p in _file_order(inp)]
    rp.verdicts["dump"] = _graded(inp, conv, ids, order)
    root = view.location.root if view.location is not None else None
    mla = uses_mla("vllm", root, conv.cc.path, conv.cc.class_name) if root is not None else None
    refusal = _first_refusal(nat, "mla")
    if mla is not None and rp.verdicts["dump"].ok is not False:
        says = f"{conv.cc.class_name}'s attention is MLA {mla.text}" + (f" ({mla.cite.where})" if mla.cite else "")
        against = f"; {condition_text(refusal)}" if refusal else ""
        decided = mla.text.startswith("always")
        rp.verdicts["dump"] = Verdict(False if decided else None, ("" if decided else "undecided: ") + says + against,
                                      ids, order)
    _vllm_launch(inp, nat, rp, ids, platform)


def _graded(inp: PlanInput, conv: EngineConvention, ids: list[int], order: list[str]) -> Verdict:
    L = inp.spec.num_layers
    positions = [p.position for _, p in _file_order(inp) if p.position is not None]
    unverified = conv.cc.unverified_for(positions, L)
    if unverified is not None:
        return Verdict(None, f"undecided: {unverified}", ids, order)
    return Verdict(True, f"ids {ids} through {conv.cc.class_name}'s setter write {', '.join(order)}, in that order",
                   ids, order)


def _vllm_launch(inp: PlanInput, nat: NativeCapture, rp: RoutePlan, ids: list[int], platform: str | None) -> None:
    method, connector = nat.switch[0], nat.switch[1]
    spec_cfg = {"method": method, "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}
    kv: dict = {"kv_connector": connector, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": inp.dump_dir or DUMP_DIR}}
    if platform == "cpu":
        kv.update(kv_connector=CPU_CONNECTOR, kv_connector_module_path=CPU_CONNECTOR_MODULE)
        rp.hazards.append(f"cpu: the launch names surgeon's {CPU_CONNECTOR} ({CPU_CONNECTOR_MODULE}), a subclass of "
                          f"{connector} that does not pin memory")
    rp.launch = engine_launch("vllm", ["--speculative-config", dumped_json(spec_cfg),
                                       "--kv-transfer-config", dumped_json(kv), "--no-enable-prefix-caching"])
    rp.config = {"speculative_config": spec_cfg, "kv_transfer_config": kv}
    rp.labels = [f"surgeon plan --dump-dir {inp.dump_dir or DUMP_DIR} writes the sidecar that labels every file "
                 "there (match, verify, audit, export read it)",
                 "without it: --slots vllm:" + ",".join(map(str, ids)) + " --spec " + inp.spec.file]


def _sglang_conv(view, model_class: str, algorithm: str) -> tuple[EngineConvention | None, str]:
    """The class's convention under ``algorithm``'s setter: EAGLE3's (the probed one), DFLASH's
    (``set_dflash_layers_to_capture``, run by the classifier); None with why for any other."""
    from surgeon.engines.facts.sglang_dflash import SETTER, classify_dflash, dflash_unreadable

    if algorithm.upper() == "EAGLE3":
        return view.convention(model_class), "EAGLE3"
    if algorithm.upper() == "DFLASH" and view.location is not None:
        cc = classify_dflash(view.location.root, model_class)
        if (why := dflash_unreadable(cc, model_class)) is not None or cc is None:
            return None, f"DFLASH: {why}"
        return EngineConvention(cc, f"{view.origin}; {SETTER}"), "DFLASH"
    return None, f"{algorithm}: its setter on {model_class} is not modelled"


def _sglang_dump(inp: PlanInput, nat: NativeCapture, rp: RoutePlan, view) -> None:
    from surgeon.engines.view import model_class_for

    if why := _refusals(inp, nat):
        rp.verdicts["dump"] = Verdict(False, why)
        return
    cls = model_class_for(inp.spec, "sglang")
    order = [str(p) for _, p in _file_order(inp)]
    tried: list[str] = []
    for algorithm in nat.algorithms:
        conv, label = _sglang_conv(view, cls, algorithm)
        if conv is None:
            tried.append(label)
            continue
        ids, why = _class_ids(inp, conv, view.probe)
        if ids is None:
            tried.append(f"{algorithm}: {why}")
            continue
        rp.verdicts["dump"] = _graded(inp, conv, ids, order)
        rp.verdicts["dump"].why += f" (--speculative-algorithm {algorithm})"
        _sglang_launch(inp, nat, rp, algorithm, ids)
        rp.hazards.extend(f"not chosen: {t}" for t in tried)
        return
    rp.verdicts["dump"] = Verdict(False, "no --speculative-algorithm's setter captures the points: " + "; ".join(tried))


def _sglang_launch(inp: PlanInput, nat: NativeCapture, rp: RoutePlan, algorithm: str, ids: list[int]) -> None:
    enable, ids_flag, algo_flag = nat.switch[0], nat.switch[1], nat.switch[2]
    rp.launch = engine_launch("sglang", [enable, algo_flag, algorithm, ids_flag, *map(str, ids)])
    rp.config = {"server_args": {enable.lstrip("-").replace("-", "_"): True,
                                 algo_flag.lstrip("-").replace("-", "_"): algorithm,
                                 ids_flag.lstrip("-").replace("-", "_"): ids}}
    rp.labels = [f"--slots sglang:{algorithm}:" + ",".join(map(str, ids)) + f" --spec {inp.spec.file}"]
    for algo, setter, cite in nat.setters:
        if algo.upper() == algorithm.upper():
            rp.evidence.append(f"{cite.where}: {algorithm} sets the ids through {setter}")


def trtllm_native(inp: PlanInput, needs: Sequence[str]) -> RoutePlan:
    """``SaveHiddenStatesDecodingConfig(eagle3_layers_to_capture=...)``, from the cited table: ids
    are layer outputs (-1: the final post-norm state, which the config adds when absent), a sorted
    set with -1 last; where the engine captures -1 was not read, so a final_norm slot is undecided."""
    from surgeon.engines.facts.field_tables import TRTLLM, TRTLLM_CONV

    rp = RoutePlan("native", TITLES["native"], {})
    if "serve" in needs:
        rp.verdicts["serve"] = Verdict(False, "SaveHiddenStatesDecodingConfig captures for a dump and loads no draft")
    rp.evidence = [str(TRTLLM[k]) for k in ("minus_one", "sorted", "minus_one_last", "dump")]
    if "dump" not in needs:
        return rp
    L = inp.spec.num_layers
    try:
        pairs = sorted((TRTLLM_CONV.to_id(p, L), str(p), n) for n, p in inp.dump_points or [])
    except NotExpressible as e:
        rp.verdicts["dump"] = Verdict(False, str(e))
        return rp
    last = [pr for pr in pairs if pr[0] == -1]
    pairs = [pr for pr in pairs if pr[0] != -1] + (last or [(-1, "final_norm", "(added)")])
    ids, order, names = [i for i, _, _ in pairs], [p for _, p, _ in pairs], [n for _, _, n in pairs]
    if last:
        rp.verdicts["dump"] = Verdict(None, f"undecided: {TRTLLM['minus_one'].says}", ids, order, names)
    else:
        rp.verdicts["dump"] = Verdict(True, f"eagle3_layers_to_capture {ids[:-1]} writes {', '.join(order[:-1])}, "
                                            "and -1 (final_norm, added by the config) last", ids, order, names)
    cfg = {"eagle3_layers_to_capture": ids, "output_directory": inp.dump_dir or DUMP_DIR}
    rp.config = {"SaveHiddenStatesDecodingConfig": cfg}
    rp.launch = engine_launch("trtllm", ["--extra_llm_api_options", "<OPTIONS>.yaml"])
    rp.labels = ["--slots trtllm:" + ",".join(map(str, ids)) + f" --spec {inp.spec.file}"]
    rp.hazards.append("a table cited from TensorRT-LLM's GitHub source, not a release read here")
    return rp
