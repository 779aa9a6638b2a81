"""User-facing errors: one clear line, exit code 2, no traceback unless --debug."""

from __future__ import annotations


class QerlError(Exception):
    """Bad input or an unusable state the user can fix. The message says what is wrong and what to do."""

    exit_code = 2


def path_error(exc: BaseException) -> QerlError | None:
    """The one line for an OS error that only a path the user gave can cause (a name longer than the file system
    takes), wherever in a stage it surfaces; None for any other error."""
    import errno

    if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
        name = exc.filename if exc.filename is not None else "a path"
        shown = name if len(str(name)) <= 120 else f"{str(name)[:100]}...({len(str(name))} characters)"
        return QerlError(f"{shown}: a name in this path is longer than the file system allows (255 bytes per name, "
                         "4096 per path): use a shorter path")
    return None


class RunLockedError(QerlError):
    """Another process is writing the same run directory."""


class OutsideRunError(QerlError):
    """A path read from a run directory (a manifest entry, `latest`, a symbolic link in it) that leads outside it."""


class StageMissingError(QerlError):
    """A stage needs the output of an earlier stage that the run directory does not have."""


class Preempted(KeyboardInterrupt):
    """SIGTERM stopped `qerl train` at a checkpoint (a scheduler preempting the job): the stage is recorded
    `interrupted` like Ctrl-C, and the command exits 143 (128 + SIGTERM), as schedulers expect."""

    exit_code = 143
