"""The audit of a whole training set (``surgeon audit``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from surgeon.commands.progress import QUIET, Progress


def _writable_report(path: str) -> None:
    """``--report PATH`` checked before the audit, not after it: a writable folder, and nothing at
    PATH (the report, as every ``-o`` of surgeon, never overwrites a file nor writes through a link;
    :func:`surgeon.core.safefile.write_file` checks again when it writes)."""
    import os

    from surgeon.core.errors import BadInput
    from surgeon.core.safefile import describe_mode

    folder = Path(path).parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise BadInput(f"--report {path}: {folder} is {'not writable' if folder.is_dir() else 'no folder'} "
                       "(checked before the audit, not after it)")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise BadInput(f"--report {path}: cannot inspect it ({e.strerror or e})") from None
    raise BadInput(f"--report {path}: already exists ({describe_mode(mode)}); refusing to overwrite it "
                   "(remove it, or name another file)")


def audit(*, root: str, spec: str, ref: str | None = None, workers: int | None = None, ray: str | None = None,
          resume: bool = False, report: str | None = None, structure_only: bool = False, exact: int | None = None,
          state: str | None = None, progress: Progress = QUIET) -> Any:
    """Check every file under ``root`` against ``spec``: structure, values and the identity of each
    slot (an AuditReport; exit 3 when any file holds a slot that is not what the spec declares or
    holds bad values, 4 when none does but the identity of most files of a slot is undecided).
    ``ref``: ``hf:MODEL``, a reference file, a sweep dump or a fingerprint, for the identity profile
    (``hf:`` also runs exact identification: on at most ``exact`` files, the ones the statistics
    leave undecided first; None: the automatic budget of :mod:`surgeon.audit.exact`)."""
    from surgeon.core.optional import require

    if report:
        require("matplotlib")  # before the work, not after it
        _writable_report(report)
    if ray:
        require("ray")
    from surgeon.audit.pipeline import Plan, run_audit

    plan = Plan(Path(root), spec, ref, workers, ray, resume, structure_only, exact,
                Path(state) if state else None)
    with progress.bar(f"auditing {root}") as update:
        result = run_audit(plan, update)
    if report:
        from surgeon.audit.html import write_report

        with progress.spinner("writing the HTML report"):
            result.report_path = str(write_report(result, report))
    return result
