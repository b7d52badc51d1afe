"""How a tool hands back what it measured: the report printed, the numbers (JSON) and the report
(markdown) written where the command line asked, each file whole or not at all; a folder that
cannot be written is one line (exit 2), a full disk one line (exit 3), through
dancegrpo.errors.exit_on_config_error as every command line's other errors."""
import contextlib
import json
import math
import os

from dancegrpo.errors import ConfigError, RunHalted, is_disk_full
from dancegrpo.utils.atomic import write_text


class OutputError(ConfigError):
    """--out cannot be written (permissions, a file in the way): the message names it (exit 2)."""


class OutputFull(RunHalted):
    """No space left under --out; what was written before stays whole (exit 3)."""


@contextlib.contextmanager
def output_errors(out):
    """Turn an OSError of writing the outputs into OutputError / OutputFull, one line each."""
    try:
        yield
    except OSError as e:
        if is_disk_full(e):
            raise OutputFull(f"no space left to write under --out {out!r} ({e.strerror}); the files written "
                             "are whole, the rest are missing: free space and run again") from None
        where = f" ({e.filename})" if e.filename and os.path.abspath(e.filename) != os.path.abspath(out) else ""
        raise OutputError(f"cannot write under --out {out!r}: {e.strerror}{where}; give a folder you can write "
                          "to") from None


def finite_or_null(value):
    """`value` with every NaN / inf float turned to None: JSON has no NaN (json.dumps would write a bare
    NaN, which strict readers refuse); a number a run could not give is null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def json_text(value):
    """Strict JSON of a tool's numbers (NaN / inf as null)."""
    return json.dumps(finite_or_null(value), indent=1, allow_nan=False)


def print_and_write(report, result, json_path=None, md_path=None):
    print(report, flush=True)
    for path, text in ((json_path, json_text(result)), (md_path, report + "\n")):
        if path:
            write_text(path, text)
