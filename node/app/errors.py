"""The errors the command line reports as one line, no traceback: the user's mistake (exit code 2)
and a runtime failure that is nobody's input error (exit code 1: a peer that does not answer)."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


class RuntimeFailure(Exception):
    """The command was fine but could not be carried out (unreachable peer...): one line, exit code 1."""
