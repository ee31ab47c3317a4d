"""Errors labkit reports to a user as a message and exit code 2, never as a traceback."""


import sys
from collections.abc import Callable


class InputError(ValueError):
    """Bad input from the user: a missing lab, a malformed submission folder, a bad manifest."""


def exit_code(command: Callable[[], int]) -> int:
    """What a command line returns: `command()`, or 2 with one line on stderr for an
    InputError (never a traceback)."""
    try:
        return command()
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
