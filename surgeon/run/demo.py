"""`surgeon demo`: the whole loop on the real vLLM engine, on a tiny model made here.

1. make a tiny random HF model from the demo spec's target (``specs/demo-tiny-llama-eagle3.yaml``,
   adjacent layers a few percent apart so every layer is distinguishable);
2. record the HF reference of every point for the prompt;
3. ``plan`` the capture route (:mod:`surgeon.patch.routes`) and take the one it recommends for the
   dump: the plugin (``apply --deliver plugin``: a package on PYTHONPATH, the engine's files only
   read) or the on-disk patch (``apply``, then ``revert``, always, even on failure);
4. run vLLM on the model (a subprocess) and drain the captures into a self-describing dump;
5. check the model file is byte-identical to before;
6. ``verify`` the dump against the reference: every slot is what the spec says;
7. a mis-wired variant, the mistake that started this project (the labels shifted to
   ``[embed, layer_out[1], layer_out[3]]``), is caught: each slot's true point is named, and the
   heatmap is written to a PNG;
8. the draft as evidence, offline (:mod:`surgeon.draft.demo`): a tiny EAGLE-3 draft trained on a
   synthetic induction target (cached), its wiring inferred from its weights and behaviour with
   margins, and its acceptance under that wiring and the wirings bugs produce;
9. print where everything is (the CLI).

The library function :func:`run_demo` does the work and reports each step to a callback; the CLI
shows it with rich.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from surgeon.core.data import data_file
from surgeon.core.errors import BadInput
from surgeon.core.shapes import Reads

if TYPE_CHECKING:  # harness imports torch; the demo imports it only when it runs the check
    from surgeon.verify.harness import HarnessResult

DEMO_SPEC_NAME = "demo-tiny-llama-eagle3.yaml"  # in specs/, shipped in the wheel (surgeon.core.data)
PROMPT = [1, 41, 293, 90, 28, 114, 105, 75, 272, 178, 39, 287, 15, 56, 302, 45, 136, 34, 29, 103, 76,
          264, 100, 256, 165, 235, 2]  # 27 tokens, inside the tiny models' vocabulary (320)
_FAMILY = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2",
           "MistralForCausalLM": "mistral"}


@dataclass
class DemoResult:
    workdir: Path
    model: Path
    spec: Path
    wrong_spec: Path
    reference: Path
    dump: Path
    heatmap: Path
    heatmap_right: Path
    engine_root: Path
    model_file: str
    right: HarnessResult | None = None  # the spec's wiring
    wrong: HarnessResult | None = None  # the mis-wired labels
    reverted_identical: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    draft: Any = None  # surgeon.draft.demo.DraftDemo
    route: str = "patch"  # the route `surgeon plan` recommended and the demo took: plugin or patch

    @property
    def ok(self) -> bool:
        """The spec's wiring verified, the mis-wiring was caught, the revert is byte-identical, and
        the draft step (where run) named its trained wiring."""
        return bool(self.right is not None and self.right.ok and self.wrong is not None and not self.wrong.ok
                    and self.reverted_identical and (self.draft is None or self.draft.ok))

    reverted_byte_identical = Reads("reverted_identical")

    timings_s = Reads("timings")  # printed to the hundredth (surgeon.core.shapes.Timings)


def _reverted_byte_identical(model_file: Path, original_sha: str, hooks_file: Path) -> bool:
    """Whether the revert restored the model file byte for byte and removed the hooks module it added."""
    return hashlib.sha256(model_file.read_bytes()).hexdigest() == original_sha and not hooks_file.exists()


def _wrong_spec_text(text: str) -> str:
    """The demo spec with its captures labelled the way the Kimi-K2.5 dumps were: an embed slot
    first and every layer label one slot late (what the draft really read is unchanged)."""
    before = "  low: layer_out[1]\n  mid: layer_out[3]\n  high: layer_out[5]\n"
    after = "  low: embed\n  mid: layer_out[1]\n  high: layer_out[3]\n"
    if before not in text:
        raise BadInput(f"{DEMO_SPEC_NAME}: the demo spec's captures changed; update _wrong_spec_text in "
                       "surgeon/run/demo.py with them")
    return (text.replace(before, after).replace("name: demo-tiny-llama-eagle3", "name: demo-tiny-llama-eagle3-miswired")
            .replace("dumps: {layout: specforge, ", "dumps: {").split("engines:")[0])


def _write_specs(work: Path) -> tuple[Path, Path]:
    """The demo spec and its mis-wired variant, written into ``work`` and loaded once to check them."""
    from surgeon.core.spec import load_spec

    spec_path = work / "spec.yaml"
    spec_text = data_file("specs", DEMO_SPEC_NAME).read_text(encoding="utf-8")
    spec_path.write_text(spec_text, encoding="utf-8")
    spec = load_spec(spec_path)
    wrong_path = work / "spec-miswired.yaml"
    wrong_path.write_text(_wrong_spec_text(spec_text), encoding="utf-8")
    load_spec(wrong_path)
    if spec.model.target.architecture not in _FAMILY:
        raise BadInput(f"{DEMO_SPEC_NAME}: the demo makes {', '.join(_FAMILY)} models, not {spec.model.target.architecture}")
    return spec_path, wrong_path


def run_demo(workdir: str | Path, *, step: Callable[[str], None] = lambda s: None,
             note: Callable[[str], None] = lambda s: None, engine_root: str | Path | None = None) -> DemoResult:
    """Run the demo in ``workdir`` (created; must be empty or absent). ``step`` is called with the
    title of each step as it starts, ``note`` with one-line details."""
    import torch

    from surgeon.core.spec import load_spec
    from surgeon.draft.demo import run_draft_demo
    from surgeon.patch.apply import manager_for
    from surgeon.run.tinymodels import GAP_SCALES, make_tiny_model
    from surgeon.verify.harness import match, plot_heatmap
    from surgeon.verify.reference import capture_reference, save_reference

    work = Path(workdir)
    if work.exists() and any(work.iterdir()):
        raise BadInput(f"{work}: exists and is not empty; the demo writes into a new folder")
    work.mkdir(parents=True, exist_ok=True)
    work = work.resolve()
    t: dict[str, float] = {}

    spec_path, wrong_path = _write_specs(work)
    spec = load_spec(spec_path)
    family = _FAMILY[spec.model.target.architecture]

    step(f"making a tiny random {family} ({spec.num_layers} layers, hidden {spec.hidden_size})")
    t0 = time.perf_counter()
    model = make_tiny_model(family, work / "model", num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                            residual_scale=GAP_SCALES[family])
    t["model"] = time.perf_counter() - t0

    step("recording the HF reference of every point")
    t0 = time.perf_counter()
    ref_path = work / "reference.safetensors"
    save_reference(capture_reference(model, torch.tensor(PROMPT)), ref_path)
    t["reference"] = time.perf_counter() - t0

    step("planning the capture route (surgeon plan): the least intrusive route that writes the spec's dump")
    route = _plan_route(spec, engine_root, note)
    t0 = time.perf_counter()
    captured = _capture_by_plugin if route == "plugin" else _capture_by_patch
    run, model_file, identical = captured(spec, model, work, engine_root, step, note)
    t["vllm"] = time.perf_counter() - t0
    manager = manager_for("vllm", engine_root)
    dump = run.dumps[0]

    step("verifying the dump against the HF reference")
    t0 = time.perf_counter()
    right = match(dump, str(ref_path), spec=spec)
    plot_heatmap(right, work / "heatmap.png")
    step("checking a mis-wired variant: the same dump labelled [embed, layer_out[1], layer_out[3]]")
    wrong = match(dump, str(ref_path), spec=load_spec(wrong_path))
    plot_heatmap(wrong, work / "heatmap-miswired.png")
    t["verify"] = time.perf_counter() - t0

    step("the draft as evidence: a tiny EAGLE-3 draft's wiring inferred and its acceptance measured (offline)")
    t0 = time.perf_counter()
    draft = run_draft_demo(work / "draft", note)
    t["draft"] = time.perf_counter() - t0
    return DemoResult(work, model, spec_path, wrong_path, ref_path, dump, work / "heatmap-miswired.png",
                      work / "heatmap.png", manager.root, model_file, right, wrong, identical, t, draft, route)


def _plan_route(spec, engine_root, note: Callable[[str], None]) -> str:
    """The route ``surgeon plan`` recommends for the demo spec's dump on this vLLM, for its CPU: the
    plugin or the on-disk patch (the demo takes either; the native path cannot write final_norm)."""
    from surgeon.patch.routes import plan

    p = plan(spec, "vllm", engine_root=engine_root, platform="cpu")
    for r in p.routes:
        v = r.verdicts["dump"]
        note(f"{r.route}: {v.state}: {v.why}")
    route = p.recommended.get("dump")
    if route not in ("plugin", "patch"):
        raise BadInput(f"surgeon plan recommends {route or 'no route'} for the demo spec's dump on vLLM "
                       f"{p.release}; the demo takes the plugin or the on-disk patch")
    note(f"recommended: {route} ({p.route(route).title})")
    return route


def _capture_by_plugin(spec, model: Path, work: Path, engine_root, step, note):
    """Build the spec's plugin in ``work/plugin`` and run vLLM with it on PYTHONPATH: the engine's
    files are only read (their sha256 checked before and after)."""
    from surgeon.patch.plugin import build_plugin
    from surgeon.run.vllm_runner import run_vllm

    step("building the plugin (surgeon apply --deliver plugin): the engine's files are only read")
    build = build_plugin(spec, engine="vllm", out=work / "plugin", engine_root=engine_root, max_tokens=128)
    model_file = build.modules[0].relpath
    path = Path(build.engine_root) / model_file
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    note(f"built {build.package}: carries {model_file} ({build.modules[0].loop_class}); {build.activate}")
    step("running the model on vLLM with the plugin (starting the engine takes a while on a CPU)")
    run = run_vllm(model, [PROMPT], mode="hooks", out_dir=work / "dumps", progress=note, extra_env=build.environment())
    identical = hashlib.sha256(path.read_bytes()).hexdigest() == before
    note(f"{model_file} is byte-identical to before: {identical} (a plugin never writes it)")
    return run, model_file, identical


def _capture_by_patch(spec, model: Path, work: Path, engine_root, step, note):
    """Apply the spec to the installed model file, run vLLM, and revert byte-identically."""
    from surgeon.patch.apply import apply_spec, manager_for, revert_patch
    from surgeon.run.vllm_runner import run_vllm

    manager = manager_for("vllm", engine_root)
    step(f"applying {spec.name} to vLLM at {manager.root}")
    plan = apply_spec(spec, engine="vllm", engine_root=engine_root, max_tokens=128, dry_run=True).plan
    model_file = manager.root / plan.model_file
    if manager.owners().get(plan.model_file):
        raise BadInput(f"{model_file} is already patched by {manager.owners()[plan.model_file]}: "
                       f"`surgeon revert` it first; the demo starts from the engine as shipped")
    original_sha = hashlib.sha256(model_file.read_bytes()).hexdigest()  # the file as it is before the demo
    apply_spec(spec, engine="vllm", engine_root=engine_root, max_tokens=128)
    note(f"patched {plan.model_file} ({plan.loop_class}): " + ", ".join(a.split(":")[-1] for a in plan.anchors))
    try:
        step("running the model on vLLM (starting the engine takes a while on a CPU)")
        run = run_vllm(model, [PROMPT], mode="hooks", out_dir=work / "dumps", progress=note)
    finally:
        note("reverting the patch")
        revert_patch(plan.name, engine="vllm", engine_root=engine_root)
    identical = _reverted_byte_identical(model_file, original_sha, manager.root / plan.hooks_file)
    note(f"{plan.model_file} is byte-identical to before: {identical}")
    return run, plan.model_file, identical
