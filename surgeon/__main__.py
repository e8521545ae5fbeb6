"""``python -m surgeon`` and the ``surgeon`` script.

Ctrl-C at any instant is one line on stderr and exit 130, never a traceback: while the CLI's imports
(click, rich, pydantic) load, here; while arguments are parsed or a command runs, in
``surgeon.cli._Group``; and while the interpreter shuts down after the command (atexit handlers,
the final flush), by a handler installed here on the way out that ends the process at once.
"""

import os
import signal
import sys

_LINE = b"surgeon: interrupted\n"


def _late_interrupt(signum: int, frame: object) -> None:
    """Ctrl-C once the command is over: the line, and exit 130 without running more Python."""
    try:
        os.write(2, _LINE)
    finally:
        os._exit(130)


def _leaving() -> None:
    """From here on the process only shuts down: an interrupt ends it at once (no traceback from an
    atexit handler); what the command printed is flushed first."""
    try:
        signal.signal(signal.SIGINT, _late_interrupt)
    except (ValueError, OSError):  # not the main thread: nothing to guard
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def main() -> None:
    try:
        from surgeon.cli import main as cli

        cli()
    except KeyboardInterrupt:  # during the imports, or in the instant click does not cover
        signal.signal(signal.SIGINT, _late_interrupt)
        _late_interrupt(signal.SIGINT, None)
    except SystemExit:
        _leaving()
        raise


if __name__ == "__main__":
    main()
