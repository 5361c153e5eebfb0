"""The one error the command line reports as the user's mistake (exit code 2, one line, no traceback)."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""
