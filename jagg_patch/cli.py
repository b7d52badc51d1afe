"""Command-line pieces shared by every `python -m jagg_patch[.tool] TRAINER_MODULE ...`
entry point: loading the trainer, the JAGG flags, and the start-up plan."""
import argparse
import importlib
import sys

from dancegrpo.errors import say
from dancegrpo.utils.launch import launch_world_size, print_on_rank0

from .config import AUTO_MONITOR_EVERY, DEFAULT_MIN_COS, MONITOR_SAMPLES, JaggConfig, monitor_flag_values
from .settings import ALPHA_RULES, BACKWARD_CHOICES, GROUPINGS, MODES, REUSE_MODES, resolve_backward

from .plan import describe_plan, group_cost, num_trained_windows, plan_groups, plan_windows
from .seams import SeamError, check_seams


def fail(message):
    say(f"error: {message}")
    sys.exit(2)  # argparse's code for a usage error


def require_writable(folder, flag):
    """The folder a launcher writes jagg_metrics.jsonl to, proved writable before the script it runs
    loads anything (else found so at the first line, after a rollout and an update): one line, exit 2."""
    from dancegrpo.errors import ConfigError
    from dancegrpo.run.rundir import check_writable
    try:
        check_writable(folder, flag=flag)
    except ConfigError as e:
        fail(str(e))


def load_trainer(name, usage):
    """Import a trainer module named on the command line (its parser; its seams load on first use)."""
    if name.startswith("-"):
        fail(f"the first argument must be a trainer module, got {name!r}\n\n{usage}")
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        fail(f"cannot import trainer module {name!r}: {e}")
    if not callable(getattr(module, "build_parser", None)):
        import dancegrpo
        fail(f"{name!r} is no trainer module (it has no build_parser); give one of {', '.join(dancegrpo.TRAINERS)}")
    return module


def trainer_parser(argv, tool, usage, add_flags=None, complete=False):
    """`TRAINER_MODULE [flags]` -> (module, the trainer's parser + JAGG flags + the tool's `add_flags`),
    torch-free. complete: the command line is parsed once here, so --help and a flag error are answered
    before the trainer's seams (and torch) load; it is parsed again by the caller.

    Help or no argument prints `usage` (exit 0 for --help, 2 for nothing given)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        sys.exit(0 if argv else 2)
    module = load_trainer(argv[0], usage)
    parser = add_jagg_args(module.build_parser())
    if add_flags is not None:
        add_flags(parser)
    parser.prog = f"python -m {tool} {argv[0]}"
    if complete:
        from dancegrpo.args import join_negative_values
        parser.parse_args(join_negative_values(argv[1:]))   # exits on --help or a flag error
    return module, parser


def trainer_cli(argv, tool, usage, add_flags=None):
    """trainer_parser's (module, parser), the command line answered first, and the remaining argv;
    the seams JAGG uses checked."""
    module, parser = trainer_parser(argv, tool, usage, add_flags, complete=True)
    try:
        check_seams(module)
    except SeamError as e:
        fail(str(e))
    return module, parser, argv[1:]


def take_flags(parser, args, stop_at_positional=False):
    """(the parser's flags with their values, the other arguments), in their order; stop_at_positional:
    the other arguments start at the first one that is not one of the parser's flags."""
    takes_value = {a.option_strings[0]: a.nargs != 0 for a in parser._actions if a.option_strings}
    jagg, others, i = [], [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in takes_value:
            n = 2 if takes_value[name] and "=" not in args[i] else 1
            jagg += args[i:i + n]
            i += n
        elif stop_at_positional:
            return jagg, list(args[i:])
        else:
            others.append(args[i])
            i += 1
    return jagg, others


def unknown_flag(parser, flag, what="the file"):
    """One line for a flag a launcher does not know where only its own flags may stand (before `what`,
    the file it runs) or that looks like one of them (--jagg_*), naming the closest."""
    import difflib
    known = [o for a in parser._actions for o in a.option_strings]
    close = difflib.get_close_matches(flag, known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    where = "" if flag.startswith("--jagg") else f" before {what} (its own flags go after it)"
    return f"unknown flag {flag}{where}; {hint}see --help"


def split_launcher_argv(parser, argv, what="the file", separator=None):
    """A launcher's command line `[its flags] FILE [its flags and the file's own]` -> (its flag tokens,
    FILE or None, the file's own arguments). Its flags stand before the file, or among the file's, from
    where they are taken out; after `separator` (e.g. "--") every argument is the file's. An unknown
    flag before the file, or one among the file's that looks like the launcher's (--jagg_*), is one
    line naming the closest (exit 2)."""
    before, rest = take_flags(parser, argv, stop_at_positional=True)
    cut = rest.index(separator, 1) if separator is not None and separator in rest[1:] else len(rest)
    mine, after = rest[1:cut], rest[cut + 1:]
    known = {o for a in parser._actions for o in a.option_strings}
    unknown = [a for a in rest[:1] + [a for a in mine if a.startswith("--jagg")]
               if a.startswith("-") and a.split("=", 1)[0] not in known]
    if unknown:
        fail(unknown_flag(parser, unknown[0].split("=", 1)[0], what))
    if not rest:
        return before, None, []
    tokens, theirs = take_flags(parser, mine)
    return before + tokens, rest[0], theirs + after


def _checked(cast, ok, what):
    """An argparse type: `cast` the text, then require ok(value), else 'must be <what>'."""
    def parse(text):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value
    return parse


_window = _checked(int, lambda v: v >= 2, ">= 2 (a JAGG group needs two endpoints; for the exact per-step "
                                          "backward use --jagg_frac 0 or --jagg_mode exact)")
_number = _checked(float, lambda v: 0.0 <= v <= 1.0, "in [0, 1] or 'auto'")


def _fraction(text):
    return text if text == "auto" else _number(text)


_cosine = _checked(float, lambda v: -1.0 <= v <= 1.0, "a cosine in [-1, 1]")
_count = _checked(int, lambda v: v >= 0, "an integer >= 0")
_positive = _checked(int, lambda v: v >= 1, "an integer >= 1")


def flags_text(parser, prefix="--jagg_", width=100):
    """The usage lines of the parser's flags that start with `prefix`: each flag, its values (choices
    or metavar) and its default, as the parser has them, so that a usage text cannot drift from it."""
    items = []
    for action in parser._actions:   # argparse has no public list of a parser's actions
        flag = next((o for o in action.option_strings if o.startswith(prefix)), None)
        if flag is None:
            continue
        value = "|".join(map(str, action.choices)) if action.choices else (action.metavar or "")
        default = f" ({action.default})" if action.default not in (None, False) else ""
        items.append(f"{flag}{' ' + value if value else ''}{default}")
    lines, line = [], ""
    for item in items:
        if line and len(line) + 2 + len(item) > width:
            lines.append(line)
            line = ""
        line = f"{line}  {item}" if line else f"  {item}"
    return "\n".join(lines + [line])


def add_jagg_args(parser):
    g = parser.add_argument_group("JAGG (jagg_patch)")
    g.add_argument("--jagg_window", type=_window, default=4, metavar="W",
                   help="W: transitions per group (>= 2; 2 is the exact gradient).")
    g.add_argument("--jagg_frac", type=_fraction, default=0.6, metavar="F|auto",
                   help="Fraction of the groups, highest noise first, routed to JAGG; the rest get the exact "
                        "per-step backward (rounded half up). The authors' code: 1. auto: the group positions "
                        "whose monitored cosine to the exact gradient is measured to reach --jagg_min_cos (a "
                        "one-sided 95%% confidence bound over the monitored samples, smoothed over measurements); "
                        "every position is exact until the first measurement (step 1); needs the monitor "
                        "(--jagg_monitor_every, 10 if not given). The routing is logged each step as jagg_routed "
                        "(bit p: position p runs JAGG) and printed when it changes.")
    g.add_argument("--jagg_min_cos", type=_cosine, default=None, metavar="C",
                   help=f"With --jagg_frac auto (default {DEFAULT_MIN_COS}): a position runs JAGG once the lower 95%% "
                        "bound of its cosine reaches this, and leaves JAGG when the upper bound falls below it (a "
                        "bound across it changes nothing).")
    g.add_argument("--jagg_mode", choices=MODES, default="jagg",
                   help="jagg: interpolated Jacobians (the method); endpoints: the paper's ablation "
                        "(backward at the two endpoints only, each weighted W/2); exact: per-step backward "
                        "for every group (reproduces vanilla).")
    g.add_argument("--jagg_grouping", choices=GROUPINGS, default="trained",
                   help="trained (the paper): groups of W consecutive transitions of vanilla's random trained "
                        "subset; window (the authors' code): contiguous trajectory windows of W, "
                        "timestep_fraction picks whole windows per sample.")
    g.add_argument("--jagg_alpha", choices=ALPHA_RULES, default="timestep",
                   help="Interpolation weight of member j: timestep (the paper), (t_0 - t_j) / (t_0 - t_{W-1}); "
                        "index (the authors' code), j / (W-1).")
    g.add_argument("--jagg_backward", choices=BACKWARD_CHOICES, default="auto",
                   help="joint: one autograd.backward through both endpoint graphs (the paper; under FSDP one "
                        "all-gather and one reduce-scatter per unit per group); split: each endpoint's forward "
                        "and backward in turn, one graph alive at a time (the authors' code; same gradient, half "
                        "the activations); batched: both endpoints in ONE forward (the micro-batch stacked twice) "
                        "and one backward of that graph (under FSDP each unit is gathered once for the forward and "
                        "once for the backward, one unit at a time); auto: batched on several ranks, split on one.")
    g.add_argument("--jagg_reuse_rollout", choices=REUSE_MODES, default="on_policy",
                   help="Middle members of a JAGG group take the model output the rollout computed instead of "
                        "a no-grad forward. on_policy: only before the step's first optimizer step, where it is "
                        "the same output (exact; all samples when GA covers the rollout); always: also after "
                        "(stale outputs, an approximation); off: forward every middle member. Keeps S model "
                        "outputs per sample (the size of the stored latents).")
    g.add_argument("--jagg_monitor_every", type=_count, default=None, metavar="N",
                   help="N > 0: at step 1 and every N steps, measure on the step's own samples the exact gradient "
                        "of every group position next to JAGG's and the endpoints ablation's, and log cos and "
                        "relative error per position (jagg_cos/g0, ...; jagg_patch.monitor). The training is "
                        "unchanged; the extra passes are counted apart (monitor_forwards / monitor_backwards). "
                        f"0 or not given: off (with --jagg_frac auto: {AUTO_MONITOR_EVERY} if not given, 0 refused).")
    g.add_argument("--jagg_deferred", action="store_true",
                   help="Leave the trainer's own update as it is and defer its backward through a proxy of the "
                        "model (jagg_patch.deferred, docs/deferred.md): each call in grad mode returns its output "
                        "as a leaf, the loop's own loss computes the upstream gradients, and before the clip the "
                        "proxy folds them and replays the endpoints. Same gradient as the restated update; the "
                        "replay runs chunks of the loop's own call rows (vanilla's activation peak), twice that "
                        "under --jagg_backward batched (the batched form's peak, fewer and larger passes).")
    g.add_argument("--jagg_monitor_samples", type=_positive, default=MONITOR_SAMPLES, metavar="N",
                   help="Samples the monitor measures on per rank, the step's first (over its first micro-batches "
                        "when one holds fewer); --jagg_frac auto needs >= 2 (the spread its bound is made of).")
    return parser


def jagg_config(args):
    """The JaggConfig of the parsed JAGG flags, after the checks that need the trainer's geometry
    (check_trajectory); a bad combination is one line, exit 2."""
    monitor_for_auto(args)
    try:
        return JaggConfig.from_args(args)
    except ValueError as e:
        fail(str(e))


def monitor_for_auto(args, min_cos_used=None):
    """Resolve --jagg_monitor_every and --jagg_min_cos, which default to "not given" (None) so that what
    was asked is known: --jagg_frac auto routes by the monitor's cosines, measured every
    AUTO_MONITOR_EVERY steps unless N >= 1 is given (said once) and refused with 0, which turns the
    monitor off; --jagg_min_cos is auto's threshold, said unused beside a fixed --jagg_frac (unless
    min_cos_used: a tool's own auto modes read it). Idempotent."""
    if getattr(args, "_jagg_monitor_resolved", False):
        return
    auto = args.jagg_frac == "auto"
    if auto and args.jagg_monitor_every == 0:
        fail("--jagg_frac auto routes by the monitor's measurements, which --jagg_monitor_every 0 turns off: give "
             f"N >= 1 (or leave it out: {AUTO_MONITOR_EVERY}), or a fixed --jagg_frac")
    if auto and args.jagg_monitor_every is None:
        print_on_rank0(f"notice: --jagg_frac auto routes by the monitor's cosines, measured with "
                       f"--jagg_monitor_every {AUTO_MONITOR_EVERY} (give another N to change it)")
    if not (auto if min_cos_used is None else min_cos_used) and args.jagg_min_cos is not None:
        print_on_rank0(f"notice: --jagg_min_cos is the threshold of --jagg_frac auto; with --jagg_frac "
                       f"{args.jagg_frac} it is not used")
    args.jagg_monitor_every, args.jagg_min_cos = monitor_flag_values(args.jagg_frac, args.jagg_monitor_every,
                                                                     args.jagg_min_cos)
    args._jagg_monitor_resolved = True


def monitor_samples_for_batch(args):
    """The monitor measures at most the samples a rank trains in a step: --jagg_monitor_samples above them
    is lowered to them (said once where the run monitors; a tool's _auto modes measure too); auto needs
    two of them for a spread."""
    per_rank = args.train_batch_size * (args.num_generations if args.use_group else 1)
    if args.jagg_frac == "auto" and per_rank < 2:
        fail(f"--jagg_frac auto routes by the spread of the monitor's cosines over a rank's samples, and a rank "
             f"trains {per_rank} per step: raise --train_batch_size or --num_generations, or give a fixed --jagg_frac")
    if args.jagg_monitor_samples > per_rank:
        if args.jagg_monitor_every:
            print_on_rank0(f"notice: the JAGG monitor measures the {per_rank} samples a rank trains per step "
                           f"(--jagg_monitor_samples {args.jagg_monitor_samples} asks for more)")
        args.jagg_monitor_samples = per_rank


def deferred_refusal(args):
    """Why the deferred proxy cannot run with these flags (None: it can): the part of a one-line error."""
    if getattr(args, "engine", None) == "deepspeed":
        return ("does not drive DeepSpeed (its engine runs every backward itself): use --engine fsdp or fsdp2 (the "
                "restated update runs on DeepSpeed)")
    # Another codebase's script (no --sampling_steps flag) picks its own steps; a trainer of this project
    # draws the windows (its S, None before the preset's defaults are in: checked again after).
    if args.jagg_grouping != "trained" and not hasattr(args, "sampling_steps"):
        return "groups the transitions the loop's own update trains: use --jagg_grouping trained"
    steps = getattr(args, "sampling_steps", None)
    if args.jagg_grouping == "window" and steps is not None and (steps - 1) % args.jagg_window:
        return (f"with --jagg_grouping window needs --jagg_window to divide the S-1 = {steps - 1} trainable transitions "
                "(as the authors' code does): a sample that drew a shorter last window would pad its trained steps, "
                "which the trainer's own update trains as steps")
    if args.jagg_frac == "auto" or args.jagg_monitor_every:
        return "has no fidelity monitor: give a fixed --jagg_frac and no --jagg_monitor_every"
    return None


def check_deferred(args):
    """What --jagg_deferred cannot run with, in one line before anything loads."""
    problem = deferred_refusal(args) if getattr(args, "jagg_deferred", False) else None
    if problem:
        fail(f"--jagg_deferred {problem}; or leave out --jagg_deferred")


def check_trajectory(args, min_cos_used=None):
    """The checks that need the trainer's geometry, before any model is loaded (min_cos_used: see
    monitor_for_auto)."""
    check_deferred(args)
    monitor_for_auto(args, min_cos_used)
    monitor_samples_for_batch(args)
    if args.jagg_monitor_every and args.jagg_grouping == "window" and launch_world_size() > 1:
        fail("--jagg_monitor_every with --jagg_grouping window on several ranks: the ranks' samples train "
             "different windows, so their measuring passes would not line up; use --jagg_grouping trained")
    if getattr(args, "sde_window_size", 0) and args.jagg_grouping == "window":
        fail("--sde_window_size trains one SDE window per sample, which is already the group: use the default "
             "--jagg_grouping trained (the window's K transitions form one group when --jagg_window >= K)")
    if args.jagg_grouping == "window" and args.jagg_window > args.sampling_steps - 1:
        fail(f"--jagg_grouping window needs --jagg_window <= S-1 = {args.sampling_steps - 1} trainable "
             f"transitions (--sampling_steps {args.sampling_steps}), got {args.jagg_window}; lower --jagg_window "
             "or raise --sampling_steps")
    fit_window_to_trained(args)


def trained_per_sample(args):
    """The transitions one sample trains: its SDE window (Flow-GRPO-Fast) or timestep_fraction's share."""
    from dancegrpo.algo.grpo import num_train_timesteps
    return getattr(args, "sde_window_size", 0) or num_train_timesteps(args.sampling_steps - 1, args.timestep_fraction)


def fit_window_to_trained(args):
    """A window wider than the transitions a sample trains groups them all in one group, as a window of
    exactly that many does: the flag is set to the window built (said once), so that the plan, the
    records, run_config.json and a resume's comparison all hold the window that ran."""
    trained = trained_per_sample(args)
    if args.jagg_grouping != "trained" or args.jagg_window <= max(trained, 2):
        return
    print_on_rank0(f"notice: --jagg_window {args.jagg_window} is wider than the {trained} transitions a sample "
                   f"trains: one group of all {trained}, run and recorded as --jagg_window {max(trained, 2)}")
    args.jagg_window = max(trained, 2)


def jagg_plan_text(args, output_bytes=None):
    """The plan for the configured S, timestep_fraction, grouping, window and jagg_frac.
    output_bytes(args): the bytes per sample of the kept rollout outputs (default: an image model's,
    rollout_output_bytes), or None where the flags alone do not size them."""
    output_bytes = rollout_output_bytes if output_bytes is None else output_bytes
    num_transitions = args.sampling_steps - 1  # the last transition is never trained
    window = getattr(args, "sde_window_size", 0)
    n_vanilla = trained_per_sample(args)
    deferred = getattr(args, "jagg_deferred", False)
    backward = "deferred" if deferred else resolve_backward(args.jagg_backward)
    shown = backward if deferred or args.jagg_backward != "auto" else f"auto -> {backward}"
    if deferred and resolve_backward(args.jagg_backward) == "batched":
        shown += ", batched replay: chunks of twice the loop's call rows"
    head = (f"JAGG plan (grouping {args.jagg_grouping}, alpha {args.jagg_alpha}, backward {shown}, "
            f"mode {args.jagg_mode}, window {args.jagg_window}, jagg_frac {args.jagg_frac}): "
            f"S={args.sampling_steps} -> {num_transitions} trainable transitions; ")
    if args.jagg_grouping == "trained":
        groups = plan_groups(range(n_vanilla), args.jagg_window, _plan_fraction(args))
        backwards = sum(group_cost(g, args.jagg_mode)[2] for g in groups)
        middles = sum(group_cost(g, args.jagg_mode)[1] for g in groups)
        trained = (f"the {window} transitions of each sample's SDE window (Flow-GRPO-Fast)" if window else
                   f"{n_vanilla} trained per sample (timestep_fraction {args.timestep_fraction}), a random subset "
                   "per sample sorted into denoising order")
        return "\n".join([head + f"{trained}; positions 0..{n_vanilla - 1} of that order:",
                          *describe_plan(groups, args.jagg_mode, backward), *auto_text(args),
                          f"  per sample: {backwards} transformer backwards instead of {n_vanilla}",
                          deferred_plan_text(args, groups, n_vanilla) if deferred
                          else reuse_plan_text(args, middles, output_bytes)])
    windows = plan_windows(num_transitions, args.jagg_window, _plan_fraction(args))
    n_train = num_trained_windows(len(windows), args.timestep_fraction)
    costs = sorted(group_cost(g, args.jagg_mode)[2] for g in windows)
    expected = n_train * sum(costs) / len(windows)
    return "\n".join([head + f"{len(windows)} contiguous windows, {n_train} of them drawn at random per sample and "
                      f"trained whole (timestep_fraction {args.timestep_fraction}); loss / (GA x {n_train} x "
                      f"{args.jagg_window}):",
                      *describe_plan(windows, args.jagg_mode, backward, "window", "transitions"), *auto_text(args),
                      f"  per sample: {expected:g} transformer backwards expected (min {sum(costs[:n_train])}, "
                      f"max {sum(costs[-n_train:])}) instead of "
                      f"{n_train * num_transitions / len(windows):g} with the exact backward of the same windows "
                      f"(vanilla trains {n_vanilla} transitions)",
                      deferred_plan_text(args, windows, n_train * args.jagg_window, n_train) if deferred else
                      reuse_plan_text(args, n_train * sum(group_cost(g, args.jagg_mode)[1] for g in windows)
                                      / len(windows), output_bytes)])


def deferred_plan_text(args, groups, n_trained, drawn=None):
    """What the deferred update runs per sample: the loop's own calls without grad (or the rollout's
    outputs), then the flush's replays with grad, each with its backward. drawn: under the window
    grouping, how many of `groups` (all the windows) a sample trains (the replays then an expectation)."""
    replays = sum(2 if g.jagg and args.jagg_mode != "exact" else g.size for g in groups)
    replays = replays if drawn is None else f"{drawn * replays / len(groups):g} (expected)"
    reuse = {"off": "no reuse: each of them forwarded without grad",
             "on_policy": "taken from the rollout before the step's first optimizer step, else forwarded without grad",
             "always": "taken from the rollout (stale after an optimizer step)"}[args.jagg_reuse_rollout]
    return (f"  deferred (jagg_patch.deferred, the trainer's update unpatched): per sample {n_trained} calls at the "
            f"loop's pace ({reuse}), then at the flush {replays} replayed forwards with grad and their backwards; "
            "rows the rollout record cannot place are trained exactly")


def _plan_fraction(args):
    """The fraction the plan is shown for: with auto, the most it can route (every group)."""
    return 1.0 if args.jagg_frac == "auto" else args.jagg_frac


def auto_text(args):
    if args.jagg_frac != "auto":
        return []
    return [f"  routing auto: the groups above run JAGG only once their monitored cosine reaches "
            f"{args.jagg_min_cos} (measured at step 1 and every {args.jagg_monitor_every} steps); all exact until then"]


def image_output_bytes(args, element_bytes):
    """Bytes per sample of the kept rollout outputs of an image model: S outputs of (h/16)(w/16) tokens
    x 64 features (both families pack 16 latent channels in 2x2 patches)."""
    return args.sampling_steps * (args.h // 16) * (args.w // 16) * 64 * element_bytes


def rollout_output_bytes(args):
    """This project's trainers keep their outputs as the model computed them: bf16 under autocast
    (--mixed_precision; a GPU's default), float32 otherwise."""
    import torch
    from dancegrpo.utils.precision import bytes_per_output
    return image_output_bytes(args, bytes_per_output(torch.cuda.is_available(), args.mixed_precision))


def upstream_output_bytes(args):
    """Upstream's grpo_one_step computes under CUDA bf16 autocast (float32 on a CPU-only machine),
    whatever its flags say."""
    import torch
    from dancegrpo.utils.precision import bytes_per_output
    return image_output_bytes(args, bytes_per_output(torch.cuda.is_available()))


def output_precision(args):
    """What the kept outputs are computed in, as the banner says it: the run's --mixed_precision on
    this project's trainers; an upstream file's plan sets jagg_output_precision None (upstream
    computes under CUDA bf16 autocast whatever its flags say, float32 on a CPU-only machine)."""
    import torch
    from dancegrpo.utils.precision import describe_precision
    precision = vars(args)["jagg_output_precision"] if "jagg_output_precision" in vars(args) else args.mixed_precision
    return describe_precision("cuda" if torch.cuda.is_available() else "cpu", precision)


def reuse_plan_text(args, middles_per_sample, output_bytes=rollout_output_bytes):
    """What --jagg_reuse_rollout saves per sample and costs per rank, with the configured GA. The
    rollout keeps every sample it draws; a trainer that trains fewer (HunyuanVideo's best-of-n) sets
    args.jagg_trained_per_rank."""
    if args.jagg_reuse_rollout == "off" or middles_per_sample == 0:
        return f"  rollout reuse {args.jagg_reuse_rollout}: every middle member is forwarded without grad"
    per_rank = args.train_batch_size * (args.num_generations if args.use_group else 1)
    trained = getattr(args, "jagg_trained_per_rank", None) or per_rank
    reused = trained if args.jagg_reuse_rollout == "always" else min(args.gradient_accumulation_steps, trained)
    size = output_bytes(args)
    kept = ("keeps S model outputs per sample (their size is the model's output, not set by the flags alone)"
            if size is None else f"keeps {size / 2 ** 20:.2f} MiB per sample, "
                                 f"{size / 2 ** 20 * per_rank:.1f} MiB per rank at {args.h}x{args.w} (the outputs "
                                 f"as the model computes them: {output_precision(args)})")
    trains = f"{trained} samples per rank" if trained == per_rank else f"{trained} samples a rank trains"
    return (f"  rollout reuse {args.jagg_reuse_rollout}: {middles_per_sample:g} no-grad forwards per sample taken "
            f"from the rollout for {reused} of the {trains} (GA "
            f"{args.gradient_accumulation_steps}{'; after the first optimizer step the outputs are stale' if args.jagg_reuse_rollout == 'always' and reused > args.gradient_accumulation_steps else ''}), "
            f"{middles_per_sample * reused / trained:g} per sample on average; {kept}")
