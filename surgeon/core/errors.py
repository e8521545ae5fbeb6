"""Error kinds the CLI turns into exit codes.

* :class:`BadInput` (and ``surgeon.core.spec.SpecError``): the user's input is wrong: a one-line
  message (located where there is a file), exit 2, nothing written.
* :class:`Mismatch`: the input is fine but the wiring is not what it should be (exit 3).
* anything else is an internal error: exit 1.
"""


class BadInput(Exception):
    """Wrong input from the user; the message is one line, located where there is a file."""


class Mismatch(Exception):
    """The checked wiring differs from the spec."""
