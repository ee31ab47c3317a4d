"""Errors labkit reports to a user as a message and exit code 2, never as a traceback."""


class InputError(ValueError):
    """Bad input from the user: a missing lab, a malformed submission folder, a bad manifest."""
