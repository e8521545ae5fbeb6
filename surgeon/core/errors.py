"""The one error base, and the exit code each kind of error means.

Every error surgeon raises on purpose derives from :class:`SurgeonError`, whose ``exit_code`` the
command line turns into the exit status in one place (``surgeon.cli``), so an error raised deep in
the library (a spec, a point, a probe, a patch, an engine run) is never mistaken for a crash:

* :class:`BadInput` (exit 2): the user's input is wrong: a one-line message (located where there
  is a file), nothing written. ``SpecError``, ``PointError``, ``ProbeError``, ``PatchError`` and
  ``PatchApplicationError`` are bad input.
* :class:`Mismatch` (exit 3): the input is fine but the wiring is not what it should be.
* :class:`EngineFailure` (exit 1): an engine surgeon ran (``VllmRunError``) failed; its message
  carries the engine's own words, which a traceback of surgeon would only hide.
* :class:`InternalError` (exit 1): surgeon broke its own contract (generated code that fails its
  own check, a revert that is not byte-identical).

Anything else that escapes is an unexpected internal error: exit 1, one line.

A report whose evidence does not decide (an identity the statistics cannot tell, a behaviour
search whose leader is within its noise) exits :data:`UNDECIDED` (4): neither "fine" (0) nor
"the wiring differs" (3), so a script never reads "could not judge" as "passed".
"""

from __future__ import annotations

from typing import ClassVar

UNDECIDED = 4  # the exit status of a report whose evidence does not decide (see the module's docstring)


class SurgeonError(Exception):
    """Base of every deliberate surgeon error; ``exit_code`` is what the CLI exits with."""

    exit_code: ClassVar[int] = 1

    def report_lines(self) -> list[str]:
        """What the CLI prints on stderr, one entry per line (a multi-issue error overrides it)."""
        return [f"surgeon: {self}"]


class BadInput(SurgeonError):
    """Wrong input from the user; the message is one line, located where there is a file."""

    exit_code = 2


class ReadFailure(BadInput):
    """A file that is there but could not be read: an error of the operating system (permissions,
    I/O, a network file system), which may pass; not what the file holds."""


class Unverified(BadInput):
    """An engine's answer rests on code the probe did not read where it decides the answer (which
    class runs on a platform, the runner's path to a DFlash setter): render refuses it (exit 2), and
    so does lint (an error for that engine, exit 2). An answer render still gives, marked
    ``verified: false`` (a capture site outside the files followed), is a warning in lint and an
    error under ``lint --strict``."""


class Mismatch(SurgeonError):
    """The checked wiring differs from the spec."""

    exit_code = 3


class EngineFailure(SurgeonError):
    """An engine run by surgeon failed; the message says how, in the engine's words."""

    exit_code = 1


class InternalError(SurgeonError):
    """Surgeon broke a promise of its own: a bug to report, not something the user can fix."""

    exit_code = 1

    def report_lines(self) -> list[str]:
        return [f"surgeon: internal error: {self}"]


def unreadable(exc: BaseException) -> str:
    """What a reader of engine source says of code it cannot handle (a construct it does not know,
    where it raised instead of refusing): one reason, so the file or class becomes one
    "unreadable" entry of the answer and the rest of the engine is still answered."""
    return f"unreadable: surgeon's reader cannot handle this code ({type(exc).__name__}: {exc})"
