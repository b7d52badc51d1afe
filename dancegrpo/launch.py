"""torchrun, as the launch scripts call it: `python -m dancegrpo.launch [torchrun's arguments]`.

Three things differ from a plain `torchrun`, all about stopping:
- SIGTERM / SIGINT to the launcher: torchrun passes the signal on to its workers (which finish
  their step, save a checkpoint and exit 128+signal) but then ends with a traceback and exit 1;
  here it ends with one line and 128+signal, as a single process does, so a scheduler or script
  sees a stop, not a crash.
- A worker that dies (SIGKILL from the OOM killer, a crash) or stops with an error: torchrun stops
  the others and ends with a traceback and a table, exit 1; here one line says which rank, with
  which signal or exit code, and how to continue, and the launcher exits as that rank did
  (128+signal, or its exit code).
- The grace torchrun gives its workers before SIGKILL is 30 s by default, shorter than one step of
  a real model plus a checkpoint; here it is DEFAULT_GRACE_S unless --shutdown_timeout or
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise.
"""
import os
import sys

from .errors import say

DEFAULT_GRACE_S = 900
GRACE_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def describe_failure(rank, failure):
    """The launcher's line and exit code for the rank whose end stopped the run."""
    resume = "the checkpoints written before are intact: continue with --resume_from_checkpoint latest"
    if failure.exitcode < 0:
        name = failure.signal_name()
        oom = " (what the kernel's OOM killer sends)" if name == "SIGKILL" else ""
        return (f"launcher: rank {rank} (pid {failure.pid}) was killed by {name}{oom}; the other rank(s) were "
                f"stopped; {resume}", 128 - failure.exitcode)
    return (f"launcher: rank {rank} (pid {failure.pid}) stopped with exit {failure.exitcode} (its message is "
            f"above); the other rank(s) were stopped; {resume}", failure.exitcode)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):   # answered before torch loads; torchrun's own flags are its
        print(f"usage: python -m dancegrpo.launch [torchrun's arguments] TRAINER.py|-m MODULE [its flags]\n\n"
              f"{__doc__.strip()}\n\nEvery argument is torchrun's: `torchrun --help` lists them.")
        return 0
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    if not any(a.split("=")[0] in ("--shutdown_timeout", "--shutdown-timeout") for a in argv):
        os.environ.setdefault(GRACE_ENV, str(DEFAULT_GRACE_S))
    try:
        torchrun(argv)
    except SignalException as stop:
        say(f"launcher: {stop.sigval.name}: the workers were stopped (each saves a checkpoint after its "
            "step); continue with --resume_from_checkpoint latest")
        sys.exit(128 + int(stop.sigval))
    except ChildFailedError as failed:
        line, code = describe_failure(*failed.get_first_failure())   # torchrun's root cause
        say(line)
        sys.exit(code)


if __name__ == "__main__":
    main()
