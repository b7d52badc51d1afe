"""python -m jagg_patch <trainer module> [trainer flags] [--jagg_window W] [--jagg_frac F] [--jagg_mode M]

Runs a dancegrpo trainer (e.g. dancegrpo.train_grpo_flux) with its policy-update
seam replaced by JAGG. Works the same under torchrun.
"""
import os
import sys

from .cli import jagg_plan_text, trainer_cli
from .patch import apply_jagg

USAGE = """usage: python -m jagg_patch TRAINER_MODULE [trainer flags] [--jagg_window W] [--jagg_frac F]
                          [--jagg_mode {jagg,endpoints,exact}]
       torchrun --nproc_per_node=N -m jagg_patch TRAINER_MODULE ...

Run a DanceGRPO trainer with its policy update replaced by JAGG (Jacobian-Aggregated
Group Gradient): each sample's trained transitions, in denoising order, are split into
groups of W; in the first jagg_frac of the groups (highest noise) only the two endpoints
are backpropagated, with the middle members' loss gradients interpolated onto them.

TRAINER_MODULE: one of TRAINERS
JAGG flags (added to the trainer's own parser; see `python -m jagg_patch TRAINER_MODULE --help`):
  --jagg_window W   group size, >= 2 (default 4; 2 gives the exact gradient)
  --jagg_frac F     fraction of groups routed to JAGG, in [0, 1] (default 0.6)
  --jagg_mode M     jagg (default) | endpoints (ablation) | exact (vanilla gradient)
Example: python -m jagg_patch dancegrpo.train_grpo_flux --preset tiny --output_dir out --jagg_window 4
"""


def _usage():
    import dancegrpo
    return USAGE.replace("TRAINERS", ", ".join(dancegrpo.TRAINERS))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    module, parser, rest = trainer_cli(argv, "jagg_patch", _usage())
    from dancegrpo.args import parse_args
    args = parse_args(parser, rest)
    apply_jagg(module, window=args.jagg_window, jagg_frac=args.jagg_frac, mode=args.jagg_mode)
    if int(os.environ.get("RANK", "0")) == 0:
        print(jagg_plan_text(args), flush=True)
    return _exit_on_config_error(module.main)(args)


def _exit_on_config_error(fn):
    """dancegrpo's own wrapper (user errors -> message, exit 2) where this dancegrpo has one."""
    try:
        from dancegrpo.errors import exit_on_config_error
    except ImportError:
        return fn
    return exit_on_config_error(fn)


if __name__ == "__main__":
    main()
