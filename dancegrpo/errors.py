"""Errors the user acts on, reported as one message without a traceback.

ConfigError: bad flags, paths or data, found before (or instead of) training: exit 2.
RunHalted: the run stopped itself to keep its files clean (NaN, full disk, a signal): the
message says which quantity or event, at which step, and what to try; exit code per kind.
"""
import errno
import functools
import sys


def is_disk_full(error):
    """Whether an OSError is a full disk or an exhausted quota (what stops a write with exit 3)."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


class ConfigError(ValueError):
    """Bad flags or data: the message says what is wrong and how to fix it."""


class MissingFileError(ConfigError, FileNotFoundError):
    """A model folder, checkpoint or data file is not where the flags say."""


class RunHalted(RuntimeError):
    """The run stopped before an update or a write that would have spoiled its files."""
    exit_code = 3


class NonFiniteError(RunHalted):
    """A loss, gradient norm, reward or advantage was NaN/inf: stopped before the optimizer step."""


class DiskFullError(RunHalted):
    """A checkpoint could not be written; the previous one is intact."""


class PeerLost(RunHalted):
    """Another rank's process ended (killed, crashed) while this one waited for it in a collective:
    this rank stops too; the checkpoints written before are intact."""
    exit_code = 1


class Interrupted(RunHalted):
    """SIGTERM / SIGINT / launcher gone: the run saved a checkpoint and stopped."""

    def __init__(self, message, signum):
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention for "ended by signal N"


def say(message, file=None):
    """`message` and its newline in ONE write, flushed. print() writes them apart, and stderr writes
    through: two ranks' lines then land glued on one line ("error: Aerror: B"); one write of a line
    shorter than the pipe's atomic size (4 KiB) is never cut by another process's."""
    file = sys.stderr if file is None else file
    file.write(f"{message}\n")
    file.flush()


def say_stopped(error):
    """Print a RunHalted's one line, once: where the rank may be killed while it unwinds (torchrun's
    SIGTERM to the survivors of a dead rank, once their own handlers are gone), the line is said
    first, at the point the stop is decided."""
    if not getattr(error, "said", False):
        say(f"stopped: {error}")
        error.said = True


def exit_on_config_error(fn):
    """For `__main__` entry points: print the message and exit (2 for input errors, the
    RunHalted kind's code otherwise) instead of a traceback."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except ConfigError as e:
            say(f"error: {e}")
            sys.exit(2)
        except RunHalted as e:
            say_stopped(e)
            sys.exit(e.exit_code)
    return wrapper
