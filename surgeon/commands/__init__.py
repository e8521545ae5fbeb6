"""The library as the command layer (as alembic's ``command.py`` and pre-commit's ``commands/``):
one function per CLI verb, keyword-only arguments, returning a result object.

The CLI (``surgeon.cli``) parses options, shows progress, calls one of these and renders what it
returns; anything else (which engines to probe, which patch a revert means, what counts as a
mismatch) is decided here, so a script gets the same behaviour without click.

How a command says something went wrong, one way each:

* Before there is a report (bad input, an engine that failed, a broken promise of surgeon's
  own), it raises a :class:`surgeon.core.errors.SurgeonError`, whose ``exit_code`` the CLI
  exits with.
* A report is always returned. ``json_output(verb, report)`` is exactly what ``--json`` prints
  (the report through its output model, :mod:`surgeon.commands.outputs`, under its ``"format"``
  number; its shape ``schema(output=verb)``); its verdict
  is ``exit_code`` (absent means 0; :func:`exit_code_of` reads it): 3 when the checked wiring
  differs (check-draft, verify, check-hooks, status, demo, upgrade-check: a deployed draft config
  the new release serves differently), 2 when lint finds invalid specs.
  A report with a ``problem`` also names it in one line.

Progress goes through a :class:`surgeon.commands.progress.Progress` (default: none shown).
"""

from __future__ import annotations

from collections.abc import Callable

from surgeon.commands.audit_commands import audit
from surgeon.commands.capture_commands import check_hooks, dump_info, export, hooks
from surgeon.commands.demo_command import demo
from surgeon.commands.draft_commands import accept
from surgeon.commands.harness_commands import fingerprint, match, reference, verify
from surgeon.commands.infer_commands import infer_wiring
from surgeon.commands.outputs import FORMATS, json_output
from surgeon.commands.patch_commands import apply, coverage, diff, doctor, revert, status
from surgeon.commands.plan_commands import plan
from surgeon.commands.progress import QUIET, Progress
from surgeon.commands.results import exit_code_of
from surgeon.commands.spec_commands import check_draft, conventions, explain, lint, render, review, schema, sweep_spec
from surgeon.commands.upgrade_commands import upgrade_check

# Every CLI verb and the one function behind it (tests check the CLI has no other verbs).
COMMANDS: dict[str, Callable[..., object]] = {
    "schema": schema, "lint": lint, "explain": explain, "render": render, "check-draft": check_draft,
    "review": review, "conventions": conventions, "sweep-spec": sweep_spec,
    "reference": reference, "fingerprint": fingerprint, "match": match, "verify": verify,
    "hooks": hooks, "check-hooks": check_hooks, "dump-info": dump_info, "export": export,
    "apply": apply, "revert": revert, "status": status, "diff": diff, "doctor": doctor, "coverage": coverage,
    "demo": demo, "infer-wiring": infer_wiring, "accept": accept, "audit": audit, "upgrade-check": upgrade_check,
    "plan": plan,
}

__all__ = ["COMMANDS", "FORMATS", "QUIET", "Progress", "exit_code_of", "json_output",
           "schema", "lint", "explain", "render", "check_draft", "review", "conventions", "sweep_spec",
           "reference", "fingerprint", "match", "verify", "hooks", "check_hooks", "dump_info", "export",
           "apply", "revert", "status", "diff", "doctor", "coverage", "demo", "infer_wiring", "accept", "audit",
           "upgrade_check", "plan"]
