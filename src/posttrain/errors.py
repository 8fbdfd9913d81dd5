"""Errors caused by user input found during a run (bad data rows, unreadable paths, unusable tokenizers).

The CLI prints their message without a traceback and exits with status 2, as for config errors.
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix; the message says what and how."""


class DataError(UserError):
    """A bad data row or source; the message names the file and row number."""
