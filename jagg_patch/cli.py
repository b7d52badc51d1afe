"""Command-line pieces shared by every `python -m jagg_patch[.tool] TRAINER_MODULE ...`
entry point: loading the trainer, the JAGG flags, and the start-up plan."""
import argparse
import importlib
import sys

from .core import MODES, describe_plan, plan_groups
from .seams import SeamError, check_seams


def fail(message):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)  # argparse's code for a usage error


def load_trainer(name, usage):
    """Import a trainer module named on the command line and check the seams JAGG uses."""
    if name.startswith("-"):
        fail(f"the first argument must be a trainer module, got {name!r}\n\n{usage}")
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        fail(f"cannot import trainer module {name!r}: {e}")
    try:
        return check_seams(module)
    except SeamError as e:
        fail(str(e))


def trainer_cli(argv, tool, usage):
    """`TRAINER_MODULE [flags]` -> (module, the trainer's parser + JAGG flags, the remaining argv).

    Help or no argument prints `usage` (exit 0 for --help, 2 for nothing given)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        sys.exit(0 if argv else 2)
    module = load_trainer(argv[0], usage)
    parser = add_jagg_args(module.build_parser())
    parser.prog = f"python -m {tool} {argv[0]}"
    return module, parser, argv[1:]


def _window(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (a JAGG group needs two endpoints), got {value}; "
                                         "for the exact per-step backward use --jagg_frac 0 or --jagg_mode exact")
    return value


def _fraction(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def add_jagg_args(parser):
    g = parser.add_argument_group("JAGG (jagg_patch)")
    g.add_argument("--jagg_window", type=_window, default=4,
                   help="W: consecutive trained transitions per group (>= 2; 2 is the exact gradient).")
    g.add_argument("--jagg_frac", type=_fraction, default=0.6,
                   help="Fraction of each sample's groups, highest noise first, routed to JAGG; the rest "
                        "get the exact per-step backward (rounded half up).")
    g.add_argument("--jagg_mode", choices=MODES, default="jagg",
                   help="jagg: interpolated Jacobians (the method); endpoints: the paper's ablation "
                        "(backward at the two endpoints only, each weighted W/2); exact: per-step backward "
                        "for every group (reproduces vanilla).")
    return parser


def jagg_plan_text(args):
    """The plan for the configured S, timestep_fraction, window and jagg_frac."""
    from dancegrpo.grpo import num_train_timesteps
    num_transitions = args.sampling_steps - 1  # the last transition is never trained
    n = num_train_timesteps(num_transitions, args.timestep_fraction)
    groups = plan_groups(range(n), args.jagg_window, args.jagg_frac)
    head = (f"JAGG plan (mode {args.jagg_mode}, window {args.jagg_window}, jagg_frac {args.jagg_frac}): "
            f"S={args.sampling_steps} -> {num_transitions} transitions, {n} trained per sample "
            f"(timestep_fraction {args.timestep_fraction}), a random subset per sample sorted into "
            f"denoising order; positions 0..{n - 1} of that order:")
    return head + "\n" + describe_plan(groups, args.jagg_mode)
