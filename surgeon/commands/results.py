"""What every command shares about its result: the exit status it asks for, and the text a command
generates (hooks, a filled spec), printed or written to a new file.

A command's own result type lives beside the command (``spec_commands.LintReport``, ...) or is the
library's; what ``--json`` prints is produced from it by its output model
(:func:`surgeon.commands.outputs.json_output`).
"""

from __future__ import annotations

from dataclasses import dataclass

from surgeon.core.errors import BadInput


def exit_code_of(result: object) -> int:
    """The exit status a command's result asks for: 0 unless the result says otherwise."""
    return int(getattr(result, "exit_code", 0))


@dataclass
class GeneratedText:
    """Text a command generated: printed by the caller, or already written to ``written``."""

    text: str
    written: str | None = None  # the new file it was written to; None: the caller prints it


def write_new_file(text: str, output: str | None) -> GeneratedText:
    """Write ``text`` to the new file ``output`` (never overwriting one), or hand it back to print."""
    if output is None:
        return GeneratedText(text)
    try:
        with open(output, "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise BadInput(f"{output} exists; not overwritten") from None
    except OSError as e:
        raise BadInput(f"{output}: {e.strerror or e}") from None
    return GeneratedText(text, written=output)


