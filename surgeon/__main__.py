"""``python -m surgeon`` and the ``surgeon`` script.

The CLI's imports (click, rich, pydantic) take a moment; a Ctrl-C in that moment ends with one
line and exit 130, as one during a command does (``surgeon.cli._Group.invoke``), never a traceback.
"""

import sys


def main() -> None:
    try:
        from surgeon.cli import main as cli
    except KeyboardInterrupt:
        sys.stderr.write("surgeon: interrupted\n")
        raise SystemExit(130) from None
    cli()


if __name__ == "__main__":
    main()
