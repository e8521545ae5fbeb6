"""Benchmark: dump mode (surgeon's asynchronous DumpWriter) against the usual hand-written dump
patch (a synchronous ``torch.save`` of each captured tensor inside forward) and against the
unhooked forward, on a decoder-like stack.

    .venv/bin/python benchmarks/dumps.py [--json] [--device cpu|cuda] [--steps 20] ...

The stack: ``--layers`` residual blocks ``h = h + W_k h`` (Linear hidden x hidden) and a final
LayerNorm, prefill of ``--tokens`` tokens per step, captures at three layer outputs and the final
norm (4 captures a step). Every mode runs the same steps on the same inputs, writing to a fresh
temporary directory on local disk (``--dir``); times include getting everything onto disk
(the writer's close, a final device synchronize). Targets: dump mode >= 3x the synchronous
torch.save patch's throughput, and within 10% of the unhooked forward.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from surgeon.capture.dumpwriter import DumpWriter
from surgeon.core.points import FINAL_NORM, layer_out
from surgeon.core.spec import load_spec


class Stack(nn.Module):
    def __init__(self, layers: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(32000, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        for lin in self.layers:
            nn.init.normal_(lin.weight, std=0.2 / hidden ** 0.5)
        self.hook = None  # hook(point, tensor) called inside forward

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for k, lin in enumerate(self.layers):
            h = h + lin(h)
            if self.hook is not None:
                self.hook(layer_out(k), h)
        h = self.norm(h)
        if self.hook is not None:
            self.hook(FINAL_NORM, h)
        return h


def spec_for(layers: int, hidden: int, picks: list[int]):
    caps = "\n".join(f"  l{k}: layer_out[{k}]" for k in picks) + "\n  post: final_norm\n"
    text = (f"spec: 1\nname: bench\ntarget: {{architecture: Bench, num_layers: {layers}, hidden_size: {hidden}}}\n"
            f"captures:\n{caps}draft: {{kind: eagle3, fc_input: [{', '.join(f'l{k}' for k in picks)}]}}\n")
    return load_spec("bench.yaml", text=text)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(mode: str, model: Stack, batches: list[torch.Tensor], spec, out: Path, device, max_queue: int,
        first_step: int = 0) -> tuple[float, float]:
    """(wall seconds including the drain to disk, seconds the forward thread spent dumping)."""
    wanted = {p: n for n, p in spec.captures.items()}
    writer = None
    step = {"i": 0}
    stall = [0.0]
    if mode == "sync_torch_save":
        def hook(point, h):  # the usual patch: save each capture as it is computed
            name = wanted.get(point)
            if name is not None:
                t = time.perf_counter()
                torch.save(h.detach().cpu(), out / f"step{step['i']:04d}_{name}.pt")
                stall[0] += time.perf_counter() - t
        model.hook = hook
    elif mode == "dump":
        writer = DumpWriter(out, spec=spec, engine="bench", model="stack", max_queue=max_queue)
        captured: list = []

        def hook(point, h):  # collect references; the writer stages them after the step
            name = wanted.get(point)
            if name is not None:
                captured.append((name, point, h.detach()))
        model.hook = hook
    else:
        model.hook = None
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, ids in enumerate(batches):
            step["i"] = first_step + i
            model(ids)
            if writer is not None:
                t = time.perf_counter()
                writer.submit(captured, ids)  # stages (copies) and queues; blocks only when the queue is full
                stall[0] += time.perf_counter() - t
                captured.clear()
    if writer is not None:
        writer.close()
    sync(device)
    elapsed = time.perf_counter() - t0
    model.hook = None
    return elapsed, stall[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-queue", type=int, default=4)
    ap.add_argument("--dir", default=None, help="parent of the temporary output directories (local disk)")
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.manual_seed(0)
    picks = [1, a.layers // 2 - 1, a.layers - 3]
    spec = spec_for(a.layers, a.hidden, picks)
    model = Stack(a.layers, a.hidden).to(device=device, dtype=dtype).eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 32000, (a.tokens,), generator=g).to(device) for _ in range(a.steps)]
    root = Path(tempfile.mkdtemp(prefix="surgeon-bench-", dir=a.dir))
    times: dict[str, float] = {}
    stalls: dict[str, float] = {}
    bytes_per_step = (len(picks) + 1) * a.tokens * a.hidden * torch.finfo(dtype).bits // 8
    try:
        # warm-up: kernels, allocator, page cache paths
        run("unhooked", model, batches[:2], spec, root, device, a.max_queue)
        # two passes over halves of the steps, in ABC then CBA order, so drift (thermal, page
        # cache, noisy neighbours) hits every mode alike; each mode's time is the sum of both
        modes = ("unhooked", "sync_torch_save", "dump")
        half = a.steps // 2
        for p, order in enumerate((modes, modes[::-1])):
            part = batches[:half] if p == 0 else batches[half:]
            for mode in order:
                out = root / f"{mode}{p}"
                out.mkdir()
                t, s = run(mode, model, part, spec, out, device, a.max_queue, first_step=p * half)
                times[mode] = times.get(mode, 0.0) + t
                stalls[mode] = stalls.get(mode, 0.0) + s
                shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tput = {m: a.steps * a.tokens / t for m, t in times.items()}
    report = {
        "device": str(device) + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda"
                                 else f" ({torch.get_num_threads()} threads)"),
        "dtype": str(dtype).replace("torch.", ""), "layers": a.layers, "hidden": a.hidden, "tokens_per_step": a.tokens,
        "steps": a.steps, "captures_per_step": len(picks) + 1, "mb_written_per_step": round(bytes_per_step / 2**20, 1),
        "seconds": {m: round(t, 3) for m, t in times.items()},
        "tokens_per_s": {m: round(v, 1) for m, v in tput.items()},
        "dump_vs_sync_torch_save": round(tput["dump"] / tput["sync_torch_save"], 2),
        "dump_vs_unhooked": round(tput["dump"] / tput["unhooked"], 3),
        "forward_thread_ms_per_step_spent_dumping": {
            m: round(1000 * stalls[m] / a.steps, 1) for m in ("sync_torch_save", "dump")
        },
        "forward_ms_per_step_unhooked": round(1000 * times["unhooked"] / a.steps, 1),
        "targets": {"dump_vs_sync_torch_save": ">= 3.0", "dump_vs_unhooked": ">= 0.90"},
    }
    report["met"] = {"dump_vs_sync_torch_save": report["dump_vs_sync_torch_save"] >= 3.0,
                     "dump_vs_unhooked": report["dump_vs_unhooked"] >= 0.90}
    if a.json:
        json.dump(report, sys.stdout)
        print()
        return
    print(f"{report['device']} {report['dtype']}: {a.layers} layers x hidden {a.hidden}, {a.tokens} tokens/step, "
          f"{a.steps} steps, {report['captures_per_step']} captures ({report['mb_written_per_step']} MB/step)")
    for m, t in times.items():
        print(f"  {m:16s} {t:8.3f} s  {tput[m]:10.1f} tok/s")
    print(f"  dump vs sync torch.save: {report['dump_vs_sync_torch_save']}x (target >= 3)")
    print(f"  dump vs unhooked:        {report['dump_vs_unhooked']} (target >= 0.90)")
    st = report["forward_thread_ms_per_step_spent_dumping"]
    print(f"  forward thread ms/step spent dumping: sync torch.save {st['sync_torch_save']}, dump {st['dump']} "
          f"(unhooked forward {report['forward_ms_per_step_unhooked']} ms/step)")


if __name__ == "__main__":
    main()
