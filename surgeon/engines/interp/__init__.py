"""A small symbolic interpreter for capture setters, over libcst trees.

A setter such as SGLang's ``set_eagle3_layers_to_capture`` or vLLM's ``set_aux_hidden_state_layers``
is *run* on symbolic values instead of being pattern-matched: the explicit ids are a
:class:`Seq` (``[val + 1 for val in layer_ids]`` shifts it, ``tuple(sorted(set(x)))`` marks it
sorted and de-duplicated), the layer count is ``L`` (:class:`Lin`), ``self`` is an :class:`Obj`
whose attributes are resolved from the ``__init__`` assignments of its class hierarchy (so
``self.model`` is the class the constructor builds, in whichever file), and calls are followed
into the called method. What the run leaves behind are :class:`Store` effects (ids written to an
attribute of some object) and :class:`FlagMark` effects (a per-layer flag set for each id).

Where the outcome depends on something the source cannot decide, the run *forks*: a condition on
the ids (``layer_ids[0] == 1``) becomes a branch of the id rule; a runtime condition or an
attribute with several possible classes is explored both ways and the probe compares the
outcomes. Assumption: one pipeline rank (``is_first_rank``/``is_last_rank`` are true,
``world_size`` is 1), which is what the capture indices are defined for.
"""

from __future__ import annotations

from surgeon.engines.interp.attrs import AttributeResolver
from surgeon.engines.interp.base import Hooks, InterpBase
from surgeon.engines.interp.calls import CallBinder
from surgeon.engines.interp.exprs import ExpressionEvaluator
from surgeon.engines.interp.stmts import StatementExecutor
from surgeon.engines.interp.values import (
    Bound,
    Builtin,
    ClassRef,
    Const,
    Effect,
    Elem,
    External,
    FlagMark,
    Frame,
    FuncRef,
    IdItem,
    IdMax,
    L,
    LayerItem,
    Lin,
    Lost,
    Made,
    ModuleRef,
    Obj,
    Outcome,
    PPGroup,
    Pred,
    Raised,
    Seq,
    Site,
    Store,
    Super,
    TooManyPaths,
    Tup,
    Unknown,
    Value,
    assuming,
    describe,
    explore,
)

__all__ = ["L", "Bound", "Builtin", "ClassRef", "Const", "Effect", "Elem", "External", "FlagMark", "Frame", "FuncRef",
           "Hooks", "IdItem", "IdMax", "Interp", "InterpBase", "LayerItem", "Lin", "Lost", "Made", "ModuleRef", "Obj",
           "Outcome", "PPGroup", "Pred", "Raised", "Seq", "Site", "Store", "Super", "TooManyPaths", "Tup", "Unknown",
           "Value", "assuming", "describe", "explore"]


class Interp(StatementExecutor, CallBinder, ExpressionEvaluator, AttributeResolver):
    """The interpreter: statements, calls, expressions and attribute resolution over one run's state
    (:class:`InterpBase`). Construct one per run; :func:`explore` reruns it for every fork."""
