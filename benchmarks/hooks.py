"""Overhead of the generated capture hooks on a decoder-like forward pass.

A stack of ``--layers`` (default 8) blocks of ``Linear(H, H)`` with the residual carried
separately (the vLLM / SGLang shape: ``residual = hidden + residual; hidden = W(residual)``), at
``H = 4096``, run with and without the hook calls a patch inserts (``begin_step``,
``capture_position`` after the embedding and after every layer, ``capture_final`` after the
norm, and in aux mode ``aux_hidden_states``). The spec captures three fc layers and the final
norm. Hooked and unhooked steps alternate (ABBA order) so that drift, frequency scaling and
cache state hit both equally; the end-to-end overhead is the median of the per-round ratios,
minus one. On a shared or small CPU that figure is noisier than the effect, so the hook calls are
also timed alone, on tensors of the step's shapes, many times over (``overhead_isolated`` =
hooks-alone time / unhooked forward time): that is the stable figure ``within_target`` checks.

    python benchmarks/hooks.py [--json] [--tokens 1 16 256] [--mode aux|dump]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from surgeon.capture.hooks import generate_hooks_module, load_hooks_module  # noqa: E402
from surgeon.core.spec import load_spec  # noqa: E402

TARGET = 0.02


def bench_spec(num_layers: int, hidden: int):
    third = max(num_layers // 3, 1)
    text = (
        "spec: 1\nname: bench-hooks\n"
        f"target: {{architecture: Bench, num_layers: {num_layers}, hidden_size: {hidden}}}\n"
        "captures:\n"
        f"  low: layer_out[{third - 1}]\n  mid: layer_out[{min(2 * third - 1, num_layers - 1)}]\n"
        f"  high: layer_out[{num_layers - 1}]\n  last: final_norm\n"
        "draft: {kind: eagle3, fc_input: [low, mid, high]}\n"
    )
    return load_spec("bench.yaml", text=text)


class Stack(torch.nn.Module):
    def __init__(self, hooks, num_layers: int, hidden: int):
        super().__init__()
        self.hooks = hooks
        self.hooked = True
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(num_layers))
        for layer in self.layers:
            torch.nn.init.normal_(layer.weight, std=hidden ** -0.5 * 0.1)
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, x):
        hooks, on = self.hooks, self.hooked
        if on:
            hooks.begin_step(self, x.shape[0])
            hooks.capture_position(self, 0, x, None)
        hidden, residual = x, None
        for k, layer in enumerate(self.layers):
            residual = hidden if residual is None else hidden + residual
            hidden = layer(residual)
            if on:
                hooks.capture_position(self, k + 1, hidden, residual)
        out = self.norm(hidden + residual)
        if on:
            hooks.capture_final(self, out)
            if hooks.MODE == "aux":
                return out, hooks.aux_hidden_states(self)
        return out, None


def hook_calls(stack, x, hidden, residual, out) -> None:
    """Exactly the hook calls of one hooked forward, without the layers."""
    hooks = stack.hooks
    hooks.begin_step(stack, x.shape[0])
    hooks.capture_position(stack, 0, x, None)
    for k in range(len(stack.layers)):
        hooks.capture_position(stack, k + 1, hidden, residual)
    hooks.capture_final(stack, out)
    if hooks.MODE == "aux":
        hooks.aux_hidden_states(stack)


def _time(stack, x, hooked: bool) -> float:
    stack.hooked = hooked
    t0 = time.perf_counter()
    stack(x)
    return time.perf_counter() - t0


def measure(stack, tokens: int, hidden: int, *, min_rounds: int, budget_s: float, warmup_s: float) -> dict:
    x = torch.randn(tokens, hidden)
    with torch.no_grad():
        start = time.perf_counter()  # warm-up (and the hooks' one allocation): CPU matmul
        while time.perf_counter() - start < warmup_s:  # kernels take a while to settle
            _time(stack, x, True)
            _time(stack, x, False)
        ratios, on_t, off_t = [], [], []
        start = time.perf_counter()
        while len(ratios) < min_rounds or (time.perf_counter() - start < budget_s and len(ratios) < 2000):
            a1 = _time(stack, x, True)
            b1 = _time(stack, x, False)
            b2 = _time(stack, x, False)
            a2 = _time(stack, x, True)
            on_t += [a1, a2]
            off_t += [b1, b2]
            ratios.append((a1 + a2) / (b1 + b2))
        stack.hooked = True
        # the hooks alone, on tensors of the step's shapes: a stable estimate of their cost
        hs, res, out = torch.randn_like(x), torch.randn_like(x), torch.randn_like(x)
        reps = max(20, min(2000, int(0.5 / max(statistics.median(off_t) / 100, 1e-6))))
        alone = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                hook_calls(stack, x, hs, res, out)
            alone.append((time.perf_counter() - t0) / reps)
    hooks_ms = statistics.median(alone) * 1e3
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else [min(ratios), statistics.median(ratios), max(ratios)]
    overhead = statistics.median(ratios) - 1.0
    return {
        "tokens": tokens,
        "rounds": len(ratios),
        "unhooked_ms": statistics.median(off_t) * 1e3,
        "hooked_ms": statistics.median(on_t) * 1e3,
        "overhead": overhead,
        "overhead_iqr": [q[0] - 1.0, q[-1] - 1.0],
        "hooks_alone_ms": hooks_ms,
        "overhead_isolated": hooks_ms / (statistics.median(off_t) * 1e3),
        "within_target": hooks_ms / (statistics.median(off_t) * 1e3) <= TARGET,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mode", choices=["aux", "dump"], default="aux")
    ap.add_argument("--min-rounds", type=int, default=10)
    ap.add_argument("--budget", type=float, default=4.0, help="seconds of rounds per token count (at least --min-rounds)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of warm-up per token count")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    spec = bench_spec(args.layers, args.hidden)
    hooks = load_hooks_module(generate_hooks_module(spec, mode=args.mode, max_tokens=max(args.tokens)), "_surgeon_bench_hooks")
    stack = Stack(hooks, args.layers, args.hidden).eval()
    results = [measure(stack, t, args.hidden, min_rounds=args.min_rounds, budget_s=args.budget,
                       warmup_s=args.warmup) for t in args.tokens]
    report = {
        "benchmark": "hooks", "mode": args.mode, "hidden": args.hidden, "layers": args.layers,
        "captures": list(hooks.NAMES), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "target_overhead": TARGET, "results": results,
        "within_target": all(r["within_target"] for r in results),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"hooks overhead, {args.mode} mode, {args.layers} x Linear({args.hidden}), {report['threads']} threads")
        for r in results:
            print(f"  tokens {r['tokens']:>5}: unhooked {r['unhooked_ms']:8.2f} ms  hooked {r['hooked_ms']:8.2f} ms  "
                  f"overhead {r['overhead'] * 100:+6.2f}% "
                  f"(IQR {r['overhead_iqr'][0] * 100:+.2f}..{r['overhead_iqr'][1] * 100:+.2f}%)"
                  f"  hooks alone {r['hooks_alone_ms']:.3f} ms = {r['overhead_isolated'] * 100:.3f}%  rounds {r['rounds']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
