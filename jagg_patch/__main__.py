"""python -m jagg_patch <trainer module> [trainer flags] [--jagg_* flags]

Runs a dancegrpo trainer (e.g. dancegrpo.train_grpo_flux) with its policy-update
seam replaced by JAGG. Works the same under torchrun.
"""
import sys

from dancegrpo.errors import say
from dancegrpo.utils.launch import print_on_rank0

from .cli import check_deferred, check_trajectory, jagg_config, jagg_plan_text, trainer_cli

USAGE = """usage: python -m jagg_patch TRAINER_MODULE [trainer flags] [--jagg_* flags]
       torchrun --nproc_per_node=N -m jagg_patch TRAINER_MODULE ...

Run a DanceGRPO trainer with its policy update replaced by JAGG (Jacobian-Aggregated
Group Gradient): in the first jagg_frac of each sample's groups of W
transitions (highest noise) only the two endpoints are backpropagated, with the middle
members' loss gradients interpolated onto them. JAGG flags (defaults in brackets; each is
explained by TRAINER_MODULE --help):
JAGG_FLAGS
--jagg_backward auto: batched on several ranks, split on one. --jagg_deferred: the trainer's own
update, unpatched, through the deferred proxy.
TRAINER_MODULE: one of TRAINERS. The defaults are the paper's variant; the authors' code is
  --jagg_grouping window --jagg_alpha index --jagg_backward split --jagg_frac 1
Example: python -m jagg_patch dancegrpo.train_grpo_flux --preset tiny --output_dir out --jagg_window 4
"""


def _usage():
    import argparse

    import dancegrpo
    from .cli import add_jagg_args, flags_text
    return (USAGE.replace("TRAINERS", ", ".join(dancegrpo.TRAINERS))
            .replace("JAGG_FLAGS", flags_text(add_jagg_args(argparse.ArgumentParser()))))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    module, parser, rest = trainer_cli(argv, "jagg_patch", _usage())
    from dancegrpo.args import join_negative_values, parse_args
    check_deferred(parser.parse_args(join_negative_values(rest)))   # before the engine's own checks (an install)
    args = parse_args(parser, rest)
    check_trajectory(args)
    from .patch import apply_deferred, apply_jagg   # the update (torch) loads once the command line is answered
    (apply_deferred if args.jagg_deferred else apply_jagg)(jagg_config(args), trainer_module=module)
    print_on_rank0(jagg_plan_text(args))
    return _exit_on_deferred_error(_exit_on_config_error(module.main))(args)


def _exit_on_deferred_error(fn):
    """A run the deferred proxy stops (its replay guard, an argument changed in place): one line, exit 1."""
    def run(*args):
        from .deferred import DeferredError
        try:
            return fn(*args)
        except DeferredError as e:
            say(f"error: {e}")
            sys.exit(1)
    return run


def _exit_on_config_error(fn):
    """dancegrpo's own wrapper (user errors -> message, exit 2) where this dancegrpo has one."""
    try:
        from dancegrpo.errors import exit_on_config_error
    except ImportError:
        return fn
    return exit_on_config_error(fn)


if __name__ == "__main__":
    main()
