"""Several command lines one after another in ONE new process: `python tests/run_mains.py SPECS_JSON`.
A `python -m` start costs ~10 s of imports on 2 CPU cores, a tiny run a second or two; this is for
runs that must not share the test process (DeepSpeed's process group and environment) but need
not each have their own.

SPECS_JSON: a list of {"argv": [module, flags...], "log": PATH}. Each runs as helpers.run_main runs
it (the module's `__main__` block), its stdout and stderr written to PATH.out and PATH.err, its exit
status to PATH.code.
"""
import contextlib
import json
import sys

from helpers import run_main


def main(specs_path):
    with open(specs_path) as f:
        specs = json.load(f)
    for spec in specs:
        with open(spec["log"] + ".out", "w") as out, open(spec["log"] + ".err", "w") as err:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = run_main(*spec["argv"])
        with open(spec["log"] + ".code", "w") as f:
            f.write(str(code))


if __name__ == "__main__":
    main(sys.argv[1])
