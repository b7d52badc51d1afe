"""Errors caused by the user's input (paths, flags, data), reported without a traceback."""
import functools
import sys


class ConfigError(ValueError):
    """Bad flags or data: the message says what is wrong and how to fix it."""


class MissingFileError(ConfigError, FileNotFoundError):
    """A model folder, checkpoint or data file is not where the flags say."""


def exit_on_config_error(fn):
    """For `__main__` entry points: print the message and exit 2 instead of a traceback."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
    return wrapper
