"""The flags of the tools built on a trainer's parser (diagnostics, fidelity, bench_update), torch-free,
and `answer_first`: each tool's `python -m` run answers --help and a flag error with them before its
own module (torch, the models) loads, as the trainers and `python -m jagg_patch` do."""
import sys

DEFAULT_MODES = ("vanilla", "jagg", "jagg_split", "jagg_batched", "jagg_reuse", "jagg_split_reuse",
                 "jagg_batched_reuse", "exact", "endpoints")


def add_diag_args(parser):
    g = parser.add_argument_group("diagnostics")
    g.add_argument("--diag_samples", type=int, default=32, help="Samples of the rollout to measure on.")
    g.add_argument("--diag_warmup_steps", type=int, default=0, help="Vanilla training steps before measuring.")
    g.add_argument("--diag_params", default=None,
                   help="Regex: measure the gradient of matching parameters only, e.g. "
                        "'transformer_blocks\\.0\\.' (needed to fit 12B / 20B models; default: all).")
    return g


def add_fidelity_args(parser):
    add_diag_args(parser)
    g = parser.add_argument_group("fidelity")
    g.add_argument("--fid_rollouts", type=int, default=3, help="Rollouts to average over.")
    g.add_argument("--fid_out", default=None, help="Write fidelity.{json,csv,md} here.")
    return g


def add_bench_args(parser):
    g = parser.add_argument_group("benchmark")
    g.add_argument("--bench_reps", type=int, default=3, help="Timed repetitions of each mode (after one warm-up).")
    g.add_argument("--bench_unit_reps", type=int, default=3,
                   help="Unit-cost measurements after each repetition of the modes.")
    g.add_argument("--bench_rollout_reps", type=int, default=1,
                   help="Timed rollouts after each repetition of the modes (median over all).")
    g.add_argument("--bench_modes", default=",".join(DEFAULT_MODES), help="Comma list; vanilla is the reference.")
    g.add_argument("--bench_target_step", type=float, default=None,
                   help="Check the headline mode's whole-step speedup against this (e.g. 0.25); none by default.")
    g.add_argument("--bench_target_update", type=float, default=None,
                   help="Check the headline mode's update-phase speedup against this; none by default.")
    g.add_argument("--bench_paper_step_gain", type=float, default=None,
                   help="The paper's whole-step gain to print beside the step target (e.g. 0.183 for Flux).")
    g.add_argument("--bench_json", default=None, help="Write the raw numbers here (JSON).")
    g.add_argument("--bench_md", default=None, help="Write the report here (markdown).")
    return g


def answer_first(tool, usage, add_flags, argv=None):
    """The tool's whole command line parsed once, torch-free: --help, no trainer module and a flag error
    end here (exit 0 / 2); otherwise nothing happens and the tool's main parses it again."""
    from ..cli import trainer_parser
    trainer_parser(sys.argv[1:] if argv is None else list(argv), tool, usage, add_flags, complete=True)
