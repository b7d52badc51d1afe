"""torchrun, as the launch scripts call it: `python -m dancegrpo.launch [torchrun's arguments]`.

Two things differ from a plain `torchrun`, both about stopping:
- SIGTERM / SIGINT to the launcher: torchrun passes the signal on to its workers (which finish
  their step, save a checkpoint and exit 128+signal) but then ends with a traceback and exit 1;
  here it ends with one line and 128+signal, as a single process does, so a scheduler or script
  sees a stop, not a crash.
- The grace torchrun gives its workers before SIGKILL is 30 s by default, shorter than one step of
  a real model plus a checkpoint; here it is DEFAULT_GRACE_S unless --shutdown_timeout or
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise.
"""
import os
import sys

DEFAULT_GRACE_S = 900
GRACE_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def main(argv=None):
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun
    argv = sys.argv[1:] if argv is None else list(argv)
    if not any(a.split("=")[0] in ("--shutdown_timeout", "--shutdown-timeout") for a in argv):
        os.environ.setdefault(GRACE_ENV, str(DEFAULT_GRACE_S))
    try:
        torchrun(argv)
    except SignalException as stop:
        print(f"launcher: {stop.sigval.name}: the workers were stopped (each saves a checkpoint after its "
              "step); continue with --resume_from_checkpoint latest", file=sys.stderr, flush=True)
        sys.exit(128 + int(stop.sigval))


if __name__ == "__main__":
    main()
