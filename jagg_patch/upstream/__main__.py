"""python -m jagg_patch.upstream [--jagg_* flags] TRAINER.py [upstream's flags]

Runs an upstream DanceGRPO trainer file (fastvideo/train_grpo_flux.py, train_grpo_flux_lora.py,
train_grpo_qwenimage.py, train_grpo_qwenimage_edit.py, train_grpo_wan_2_1.py, train_grpo_hunyuan.py,
train_grpo_skyreels_i2v.py) with its train_one_step replaced by JAGG: the restated step for a known
release, the file's own step with its backward deferred otherwise (and with --jagg_deferred);
train_grpo_sd.py with the model accelerate prepares behind the deferred proxy. Works the same under
torchrun.
"""
import argparse
import os
import sys

from dancegrpo.errors import exit_on_config_error, say
from dancegrpo.utils.command_line import CommandParser
from dancegrpo.utils.launch import launch_rank, print_on_rank0

from ..cli import (add_jagg_args, check_trajectory, fail, flags_text, jagg_config, jagg_plan_text, monitor_for_auto,
                   require_writable, split_launcher_argv)
from ..settings import resolve_backward
from .fingerprint import UpstreamChanged, UpstreamUnsupported, describe_fingerprint, file_kind, fingerprint
from .loader import has_main_block, load_trainer, run_main_block

USAGE = """usage: python -m jagg_patch.upstream [--jagg_* flags] TRAINER.py [upstream's flags]
       torchrun --nproc_per_node=N -m jagg_patch.upstream [--jagg_* flags] fastvideo/train_grpo_flux.py ...
       python -m jagg_patch.upstream --jagg_fingerprint TRAINER.py

Run an unmodified upstream DanceGRPO trainer (train_grpo_flux.py, train_grpo_flux_lora.py,
train_grpo_qwenimage.py, train_grpo_qwenimage_edit.py, train_grpo_wan_2_1.py, train_grpo_hunyuan.py,
train_grpo_skyreels_i2v.py; any release since open-sourcing) with its train_one_step replaced by JAGG;
its own flags follow the file, unchanged. A train_one_step that is no release the restated step is
written for (an edited line) runs as it is, its own code, with the backward deferred (said in one
line); so does train_grpo_sd.py (its model prepared by accelerate). JAGG flags (removed before
upstream's parser sees the argv):
JAGG_FLAGS
--jagg_backward auto: batched on several ranks, split on one. --jagg_monitor_every N (0: off) and
--jagg_min_cos: the live fidelity monitor and --jagg_frac auto; upstream's micro-batch is one
sample: the monitor measures each rank's first sample of the step. --jagg_deferred: the file's own
train_one_step, unedited, through the deferred proxy. --jagg_allow_upstream_changes: run although
the file differs from what the adapter relies on. --jagg_fingerprint: print the file's fingerprint
(family, parameters, token hash, known release), exit.
--jagg_mode exact runs upstream's own step as it is (its gradients, returns and RNG draws).
"""


def usage():
    """USAGE with the JAGG flags as the parser has them."""
    return USAGE.replace("JAGG_FLAGS", flags_text(jagg_parser()))


def jagg_parser():
    parser = add_jagg_args(CommandParser(prog="python -m jagg_patch.upstream", usage=argparse.SUPPRESS, add_help=False))
    parser.add_argument("--jagg_allow_upstream_changes", action="store_true",
                        help="Warn instead of stopping when upstream's functions differ from what the adapter "
                             "relies on (jagg_patch.seams.UPSTREAM_SEAMS).")
    parser.add_argument("--jagg_fingerprint", action="store_true",
                        help="Print the trainer file's fingerprint (to record a release) and exit.")
    return parser


def split_argv(argv):
    """(parsed JAGG flags, trainer file, upstream's flags): the file is the first argument that is
    neither a JAGG flag nor its value; JAGG flags stand before it, or among upstream's, from where
    they are taken out."""
    parser = jagg_parser()
    jagg_tokens, script, upstream_flags = split_launcher_argv(parser, argv, "the trainer file")
    if script is None:
        fail("no trainer file given (e.g. fastvideo/train_grpo_flux.py); see --help")
    kind = check_trainer_path(script)
    return parser.parse_args(jagg_tokens), script, upstream_flags, kind


def trainer_in_folder(path):
    """A trainer file under `path` to name in the hint: one of its own train_grpo_*.py (it is the
    fastvideo package), else one in its fastvideo/ (it is the checkout), else the checkout's layout."""
    import glob
    for folder in (path, os.path.join(path, "fastvideo")):
        found = sorted(glob.glob(os.path.join(folder, "train_grpo_*.py")))
        if found:
            return found[0] if len(found) == 1 else f"{found[0]} (or {len(found) - 1} more there)"
    inside = os.path.basename(os.path.normpath(path)) == "fastvideo"
    return os.path.join(path, "train_grpo_flux.py") if inside else os.path.join(path, "fastvideo", "train_grpo_flux.py")


def check_trainer_path(path):
    """How the adapter runs the file (fingerprint.file_kind); one line, exit 2, for a path that cannot
    be upstream's trainer file."""
    if os.path.isdir(path):
        fail(f"{path!r} is a folder; give the trainer file in it, e.g. {trainer_in_folder(path)}")
    if os.path.exists(path) and not path.endswith(".py"):
        fail(f"{path!r} is not a Python file; give upstream's trainer file, e.g. fastvideo/train_grpo_flux.py")
    try:
        return file_kind(os.path.realpath(path))
    except UpstreamUnsupported as e:   # before the import, which would stop on the file's own dependencies
        fail(str(e))


def preflight(upstream_args, jagg, family, trainer=None, update="restated"):
    """The checks that need upstream's parsed flags, before upstream's main loads anything; then what
    the file was found to be (`trainer`, a fingerprint.Trainer) and the plan. update: what runs
    ("restated", "deferred", "own step": jagg_patch.upstream.patch.apply); a file of no known family
    runs its own step, and only the plan's summary is said."""
    from .families import FAMILIES
    from .step import needs_group
    if family is None:
        if launch_rank() == 0:
            print(f"jagg_patch.upstream: {trainer.describe()}" if trainer is not None else "", flush=True)
            print(f"JAGG (deferred, mode {jagg.jagg_mode}, window {jagg.jagg_window}, jagg_frac {jagg.jagg_frac}, "
                  f"alpha {jagg.jagg_alpha}): the file's own train_one_step; each trajectory's trained rows in "
                  "denoising order, cut into groups of W", flush=True)
        return
    rules = FAMILIES[family]
    missing = [name for name in rules.read_flags if not hasattr(upstream_args, name)]
    if missing:
        fail(f"upstream's parser gave no {', '.join('--' + m for m in missing)}, which jagg_patch.upstream reads "
             f"as upstream's {family} train_one_step does; is this the trainer's own parser? See "
             "docs/upstream_adapter.md")
    merged = argparse.Namespace(**{**vars(upstream_args), **vars(jagg)})
    if FAMILIES[family].needs_group and not getattr(upstream_args, "use_group", False):
        fail(needs_group(family) + "; add --use_group")
    per_rank = upstream_args.train_batch_size * (upstream_args.num_generations if upstream_args.use_group else 1)
    try:
        rules.check_flags(upstream_args)
    except ValueError as e:
        fail(str(e))
    trained = rules.trained_samples(upstream_args, per_rank)
    if upstream_args.gradient_accumulation_steps > trained:
        fail(f"--gradient_accumulation_steps {upstream_args.gradient_accumulation_steps} exceeds the {trained} "
             "samples a rank trains per step, so train_one_step would never step the optimizer (upstream then "
             "fails on an unbound grad_norm); lower it")
    if update == "restated":
        choose_backward(rules, upstream_args, jagg, per_rank)
    merged.jagg_backward, merged.jagg_trained_per_rank = jagg.jagg_backward, trained
    merged.jagg_deferred = update == "deferred"
    merged.jagg_output_precision = None   # upstream's: CUDA bf16 autocast, float32 without a GPU
    check_trajectory(merged)   # it may lower --jagg_monitor_samples to the samples a rank trains
    jagg.jagg_monitor_samples, jagg.jagg_window = merged.jagg_monitor_samples, merged.jagg_window
    try:
        FAMILIES[family].call_rows(upstream_args)
        plan = jagg_plan_text(merged, FAMILIES[family].output_bytes)
    except Exception as e:  # noqa: BLE001  (a ConfigError of the plan: a bad fraction or S; Wan without --cfg_infer)
        fail(str(e))
    if launch_rank() == 0:
        if trainer is not None:
            print(f"jagg_patch.upstream: {trainer.describe()}", flush=True)
        print(plan, flush=True)
        notice = rules.notice(upstream_args, per_rank)
        if notice:
            print(notice, flush=True)
        if FAMILIES[family].plan_note and jagg.jagg_alpha == "timestep":
            print(FAMILIES[family].plan_note, flush=True)
        if jagg.jagg_frac == "auto" and getattr(upstream_args, "resume_from_checkpoint", None):
            print("notice: a resumed upstream run starts its --jagg_frac auto routing afresh: upstream's checkpoints "
                  "hold no state of the adapter, so it measures at its first step and routes from there", flush=True)


def choose_backward(rules, upstream_args, jagg, rows):
    """The family's refusals of these flags; `--jagg_backward auto` where it would pick a form the
    trainer cannot run (SkyReels' batched forward under --cfg_infer > 1) becomes split, said once."""
    try:
        rules.check_run(upstream_args, resolve_backward(jagg.jagg_backward), rows)
        return
    except ValueError as e:
        if jagg.jagg_backward != "auto":
            fail(str(e))
        refused = str(e)
    try:
        rules.check_run(upstream_args, "split", rows)
    except ValueError as e:
        fail(str(e))
    jagg.jagg_backward = "split"
    if launch_rank() == 0:
        print(f"notice: --jagg_backward auto runs split here, not batched: {refused.split(': ', 1)[-1]}", flush=True)


def require_main_block(module, script):
    """The adapter runs the file as upstream is run, through its __main__ block (it parses the flags and
    calls main): one line, exit 2, for a file without one."""
    if not has_main_block(module):
        fail(f"{script} has no `if __name__ == \"__main__\":` block: jagg_patch.upstream runs a trainer file "
             "through it, as `python FILE` does (upstream's trainers parse their flags there); give upstream's "
             "trainer file, or call jagg_patch.upstream.apply(module) from your own entry point")


def load_or_fail(script):
    """load_trainer, or one line and exit 2 for a file that is not one to load."""
    try:
        return load_trainer(script)
    except FileNotFoundError as e:
        fail(str(e))
    except SyntaxError as e:
        fail(f"{script} is not valid Python (line {e.lineno}: {e.msg}); give upstream's trainer file, e.g. "
             "fastvideo/train_grpo_flux.py")
    except ImportError as e:
        fail(f"cannot load {script}: {e} (run it with upstream's environment, from its checkout)")
    except Exception as e:  # noqa: BLE001  (the file's own top-level code failed: said in one line)
        fail(f"cannot load {script}: its top-level code raised {type(e).__name__}: {e}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    jagg, script, upstream_argv, kind = split_argv(argv)
    monitor_for_auto(jagg)
    config = jagg_config(jagg)   # checked here, once: apply and the update take the object as it is
    if kind == "prepare":
        return run_prepared(script, config, upstream_argv)
    module = load_or_fail(script)
    if not jagg.jagg_fingerprint:
        require_main_block(module, script)
    from ..deferred import DeferredError
    from .patch import apply   # the update (torch): once the command line and the file are checked
    try:
        if jagg.jagg_fingerprint:
            print(describe_fingerprint(fingerprint(module)))
            return 0
        family = apply(module, config, allow_upstream_changes=jagg.jagg_allow_upstream_changes,
                       deferred=jagg.jagg_deferred)
    except (ValueError, UpstreamChanged, UpstreamUnsupported, DeferredError) as e:
        fail(str(e))
    upstream_main = getattr(module, "main", None)
    if not callable(upstream_main):
        fail(f"{script} defines no main(args), which upstream's `__main__` block calls and the adapter checks the "
             "flags in before it runs; give upstream's trainer file")
    trainer, update = module.train_one_step.jagg_trainer, module.train_one_step.jagg_update

    def checked_main(args):
        if getattr(args, "output_dir", None):   # where jagg_metrics.jsonl goes
            require_writable(args.output_dir, "--output_dir")
        preflight(args, jagg, family, trainer, update)
        # lowered to the samples a rank trains (the update measures that many too), auto's backward
        # turned to one the trainer runs, or the window narrowed to the transitions a sample trains
        changed = {"monitor_samples": jagg.jagg_monitor_samples, "backward": jagg.jagg_backward,
                   "window": jagg.jagg_window}
        if update in ("restated", "deferred") and any(getattr(config, k) != v for k, v in changed.items()):
            apply(module, config.replace(**changed), allow_upstream_changes=jagg.jagg_allow_upstream_changes,
                  deferred=jagg.jagg_deferred)
        return upstream_main(args)

    module.main = checked_main   # upstream's __main__ block calls main(args) by its global name
    run_deferred_errors(lambda: run_main_block(module, upstream_argv))
    return 0


def run_deferred_errors(fn):
    """A run the deferred proxy stops (its replay guard, an argument changed in place, arguments it cannot
    tell): one line, exit 1."""
    from ..deferred import DeferredError
    try:
        return fn()
    except (DeferredError, UpstreamUnsupported) as e:
        say(f"error: {e}")
        sys.exit(1)


def run_prepared(script, config, upstream_argv):
    """A trainer whose loop is inline in main() (train_grpo_sd.py): its main block runs as it is, the
    model accelerate prepares behind the deferred proxy (--jagg_mode exact: untouched); every flush's
    counts go to ./jagg_metrics.jsonl in the working folder, beside upstream's ./reward.txt."""
    module = load_or_fail(script)
    require_main_block(module, script)
    if config.mode == "exact":
        run_main_block(module, upstream_argv)
        return 0
    from ..deferred.prepare import install_at_prepare
    from ..deferred.stats import flush_record, summary
    from ..metrics_file import FlushLines
    lines = FlushLines(".", os.path.basename(script), config, flush_record)
    installed = install_at_prepare(config, on_flush=lines, on_prepare=lambda a: lines.place(a, print_on_rank0))
    try:
        run_deferred_errors(lambda: run_main_block(module, upstream_argv))
    finally:
        installed.remove(flush=False)   # the run is over: rows it left pending were never stepped
    if installed.proxies:
        print_on_rank0(summary(lines.records) + f"; counts per flush in {os.path.abspath(lines.path)}", sys.stderr)
    return 0


if __name__ == "__main__":
    exit_on_config_error(main)()   # a full disk while writing jagg_metrics.jsonl: one line, exit 3
