"""User-facing errors: one clear line, exit code 2, no traceback unless --debug."""

from __future__ import annotations


class QerlError(Exception):
    """Bad input or an unusable state the user can fix. The message says what is wrong and what to do."""

    exit_code = 2


class RunLockedError(QerlError):
    """Another process is writing the same run directory."""


class StageMissingError(QerlError):
    """A stage needs the output of an earlier stage that the run directory does not have."""
