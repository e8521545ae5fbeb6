"""Optional dependencies: which extra brings each, and the one error a missing one becomes.

The base install (``pip install hidden-state-surgeon``) reads specs and engines; the wiring
harness (references, fingerprints, match, verify, dumps, heatmaps) needs the ``harness`` extra.
A command that reaches a module of an extra that is not installed ends in exit 2 with one line
naming the module, the extra and how to install it, never in "internal error:
ModuleNotFoundError": the CLI maps the error in one place (``surgeon.cli._Group``) with
:func:`missing_dependency`, wherever the import happens; :func:`require` asks up front.
"""

from __future__ import annotations

import importlib

from surgeon.core.errors import BadInput

PACKAGE = "hidden-state-surgeon"
# top-level module -> (extra that brings it, what surgeon uses it for)
OPTIONAL: dict[str, tuple[str, str]] = {
    "torch": ("harness", "tensors: dumps, references, fingerprints, match and verify"),
    "transformers": ("harness", "running HF reference models"),
    "huggingface_hub": ("harness", "finding hf:ORG/NAME models in the local Hugging Face cache"),
    "matplotlib": ("harness", "the --plot heatmap"),
    "numba": ("harness", "the audit's per-row norm kernel"),
    "llvmlite": ("harness", "the audit's per-row norm kernel (numba's code generator)"),
    "ray": ("ray", "running an audit on a Ray cluster (--ray)"),
}
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


class MissingDependency(BadInput):
    """An optional module that the requested work needs is not installed (exit 2)."""

    def __init__(self, module: str):
        extra, purpose = OPTIONAL[module]
        how = f"pip install '{PACKAGE}[{extra}]'"
        if extra == "harness":  # it pulls torch, and pip's default torch is the 5 GB CUDA build
            how += f" (for a CPU-only torch, first: {CPU_TORCH})"
        super().__init__(f"{module} is not installed; surgeon needs it for {purpose}: {how}")
        self.module, self.extra = module, extra


def require(module: str) -> None:
    """Fail now, before any work, when the optional ``module`` (a key of :data:`OPTIONAL`) cannot
    be imported; used where the need is known up front (``--plot`` needs matplotlib)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if (missing := missing_dependency(e)) is None:
            raise
        raise missing from None


def missing_dependency(error: BaseException) -> MissingDependency | None:
    """The MissingDependency an ImportError stands for, when it is about an optional module that
    is absent (not a broken install of one that is present); None for anything else."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return None
    top = error.name.split(".", 1)[0]
    if top not in OPTIONAL or error.name != top:  # a submodule missing inside an installed package is a bug
        return None
    return MissingDependency(top)
