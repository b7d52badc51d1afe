"""python -m jagg_patch.deferred [--jagg_* flags] SCRIPT [--jagg_* flags] [-- the script's own flags]

Runs a training script, unedited, as `__main__` with JAGG's deferred backward: the proxy is installed
where the script prepares its model and optimizer (accelerate's Accelerator.prepare), so the update's
calls through the prepared model and the rollout's through the model inside (pipeline.transformer)
reach one record. The script's own flags reach it untouched (sys.argv = [SCRIPT, its flags]): absl and
ml_collections parse them as the script does. Under torchrun or `accelerate launch -m
jagg_patch.deferred` each rank runs it so (tested on the Flow-GRPO stand-in: one process and two DDP
ranks, both launch lines). A script that prepares its model otherwise can call jagg_patch.deferred.wrap
itself.
"""
import os
import sys

USAGE = """usage: python -m jagg_patch.deferred [--jagg_* flags] SCRIPT [--jagg_* flags] [-- SCRIPT's own flags]
       torchrun --nproc_per_node=N -m jagg_patch.deferred SCRIPT ...
       accelerate launch -m jagg_patch.deferred SCRIPT ...

Run a GRPO training script, unedited, with JAGG's deferred backward: the model its
accelerator.prepare returns is a proxy that defers each update call's backward, folds the
upstream gradients of W consecutive trained steps and replays the two endpoints before the
script reads the gradient (its clip, its step; docs/deferred.md; Flow-GRPO's trainers:
docs/flowgrpo.md). After `--` every argument is the script's. JAGG flags (defaults in
parentheses; --jagg_deferred and the monitor's flags are refused here; --jagg_backward batched
replays twice the script's call rows at once, the other forms its call rows):
JAGG_FLAGS
--jagg_mode exact runs the script as it is. Each flush's counts go to jagg_metrics.jsonl, one
line per flush, in --jagg_metrics_dir, else the folder the script names to accelerate
(ProjectConfiguration's project_dir), else the working folder (the path is said); the run ends
with one summary line.
"""
# The flags of the restated update this launcher has no use for, and why (one line, exit 2, when given).
UNUSED = {"--jagg_deferred": "it is the deferred update already",
          "--jagg_monitor_samples": "it has no fidelity monitor",
          "--jagg_min_cos": "it has no --jagg_frac auto"}
HELP_FLAGS = ("-h", "--help", "--helpfull", "--helpshort", "--helpxml")


def launcher_parser():
    from dancegrpo.utils.command_line import CommandParser
    from ..cli import add_jagg_args
    parser = add_jagg_args(CommandParser(prog="python -m jagg_patch.deferred", add_help=False))
    parser.add_argument("--jagg_metrics_dir", default=None, metavar="DIR",
                        help="Where jagg_metrics.jsonl (one line per flush) is written (default: the script's "
                             "accelerate project_dir, else the working folder).")
    return parser


def usage():
    from ..cli import flags_text
    return USAGE.replace("JAGG_FLAGS", flags_text(launcher_parser()))


def check_script(path):
    """The script is a Python file that exists: one line, exit 2, otherwise."""
    from ..cli import fail
    if path is None:
        fail("no script given (e.g. scripts/train_sd3.py); see --help")
    if os.path.isdir(path):
        fail(f"{path!r} is a folder; give the training script in it")
    if not os.path.isfile(path):
        fail(f"script {path!r} does not exist")
    if not path.endswith(".py"):
        fail(f"{path!r} is not a Python file; give the training script (a .py file)")


def check_used(tokens):
    """A flag of the restated update given here: one line, exit 2."""
    from ..cli import fail
    given = [t.split("=", 1)[0] for t in tokens if t.split("=", 1)[0] in UNUSED]
    if given:
        fail(f"jagg_patch.deferred has no use for {given[0]} ({UNUSED[given[0]]}): leave it out")


def run_script(path, argv):
    """The script as `__main__`, as `python SCRIPT argv...` runs it: its folder first on sys.path."""
    import runpy
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    from ..cli import deferred_refusal, fail, jagg_config, require_writable, split_launcher_argv
    parser = launcher_parser()
    tokens, script, script_argv = split_launcher_argv(parser, argv, "the script", separator="--")
    jagg = parser.parse_args(tokens)
    check_script(script)
    check_used(tokens)
    problem = deferred_refusal(jagg)
    if problem:
        fail(f"jagg_patch.deferred {problem}")
    config = jagg_config(jagg)
    if config.mode == "exact":
        run_script(script, script_argv)
        return 0
    if jagg.jagg_metrics_dir is not None:
        require_writable(jagg.jagg_metrics_dir, "--jagg_metrics_dir")
    return run_deferred(script, script_argv, config, jagg.jagg_metrics_dir)


def run_deferred(script, script_argv, config, metrics_dir):
    """SCRIPT with the proxy installed at accelerate's prepare; one summary line at its end (however it
    ends but on an error of the proxy's, which is its one line, exit 1)."""
    from dancegrpo.errors import say
    from dancegrpo.utils.launch import print_on_rank0
    from ..metrics_file import FlushLines   # torch and accelerate: once the command line is answered
    from .errors import DeferredError
    from .prepare import install_at_prepare
    from .stats import flush_record, summary
    lines = FlushLines(metrics_dir, os.path.basename(script), config, flush_record)
    installed = install_at_prepare(config, on_flush=lines, on_prepare=lambda a: lines.place(a, print_on_rank0))
    ended, failed = False, False   # the script ran to its end (absl's app.run ends in SystemExit(None) / (0))
    try:
        run_script(script, script_argv)
        ended = True
    except DeferredError as e:
        failed = True
        say(f"error: {e}")
        return 1
    except SystemExit as e:
        ended = e.code in (None, 0)
        raise
    finally:
        installed.remove(flush=False)   # the script is over: rows it left pending were never stepped
        if installed.proxies and not failed:
            print_on_rank0(summary(lines.records) + f"; counts per flush in {os.path.abspath(lines.path)}", sys.stderr)
        elif ended and not installed.proxies and not set(script_argv) & set(HELP_FLAGS):
            print_on_rank0("notice: the script prepared no model with trainable parameters through accelerate's "
                           "Accelerator.prepare: JAGG did nothing (see docs/deferred.md for a script that prepares "
                           "otherwise)", sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
