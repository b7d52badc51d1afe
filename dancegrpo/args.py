"""The command line shared by the trainers: upstream's flags with upstream's
defaults, plus this project's (preset, reward, batching, control). Flags that
did nothing upstream are accepted and say so in their help."""
import argparse
import json
import re
import sys

from . import presets
from .choices import ADVANTAGE_RULES, PRECISIONS, SDE_TYPES, SHARDING_STRATEGIES, WEIGHT_TYPES
from .engines import add_engine_args, validate_engine_args
from .utils.command_line import CommandParser, typed_flags
from .adapters.flags import add_lora_args, validate_lora_args
from .rewards import add_reward_args, check_reward_prompts, resolve_reward_spec

NOOP = "Accepted for upstream compatibility; has no effect (as upstream)."


class TrainerArgumentParser(CommandParser):
    """The trainers' parser: a flag error prints one line and a hint, not the whole usage (exit 2, as
    argparse); no abbreviated flags."""


def build_parser(family, description=None):
    p = TrainerArgumentParser(description=description or f"DanceGRPO training for {family}.")
    bool_flag = dict(action=argparse.BooleanOptionalAction, default=False)

    g = p.add_argument_group("embedded default")
    g.add_argument("--preset", choices=presets.preset_names(family), default=None,
                   help="Build small models and prompt data offline and use them as defaults "
                        "(explicit flags still win). 'tiny' trains on CPU in about a minute.")

    g = p.add_argument_group("data")
    g.add_argument("--data_json_path", type=str, default=None,
                   help="JSON written by the preprocessing script (required unless --preset).")
    g.add_argument("--dataloader_num_workers", type=int, default=10)
    g.add_argument("--train_batch_size", type=int, default=16, help="Prompts per rank per step.")
    g.add_argument("--num_latent_t", type=int, default=1, help=NOOP)

    g = p.add_argument_group("models")
    g.add_argument("--pretrained_model_name_or_path", type=str, default=None,
                   help="Local diffusers folder with transformer/ and vae/.")
    g.add_argument("--dit_model_name_or_path", type=str, default=None,
                   help="Folder holding transformer/ if it differs from the pretrained folder.")
    g.add_argument("--vae_model_path", type=str, default=None,
                   help="Folder holding vae/ if it differs from the pretrained folder.")
    g.add_argument("--cache_dir", type=str, default="./cache_dir", help="Where presets are built.")

    g = p.add_argument_group("diffusion")
    g.add_argument("--ema_decay", type=float, default=0.995)
    g.add_argument("--ema_start_step", type=int, default=0)
    g.add_argument("--cfg", type=float, default=0.0, help=NOOP)
    g.add_argument("--precondition_outputs", action="store_true", help=NOOP)
    g.add_argument("--guidance", type=float, default=3.5, help="Distilled guidance (models with guidance embeds).")

    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--output_dir", type=str, default=None, help="Metrics, reward.txt and checkpoints.")
    g.add_argument("--checkpointing_steps", type=int, default=500,
                   help="Save after every N steps' update, and always at the end.")
    g.add_argument("--resume_from_checkpoint", type=str, default=None,
                   help="A checkpoint-STEP-EPOCH folder, or 'latest' (the newest complete one in --output_dir).")
    g.add_argument("--overwrite_output_dir", action="store_true",
                   help="Delete a previous run's metrics and checkpoints in --output_dir before starting "
                        "(without it, a used folder is refused).")
    g.add_argument("--allow_config_change", action="store_true",
                   help="Resume even though flags that change the run differ from the checkpoint's.")
    g.add_argument("--checkpoints_total_limit", type=int, default=None,
                   help="Keep only the newest N checkpoints (default: keep all); older ones are deleted before "
                        "the next is written, never the newest complete one or the one the run resumed from.")
    g.add_argument("--sample_every", type=int, default=0,
                   help="Write a grid of samples (fixed prompts x fixed noise, ODE) to <output_dir>/samples/ "
                        "before training, every N steps and at the end (0: never).")
    g.add_argument("--logging_dir", type=str, default="logs", help=NOOP)
    g.add_argument("--report_to", choices=["none", "wandb"], default="none",
                   help="wandb is optional and off by default.")

    g = p.add_argument_group("optimisation")
    g.add_argument("--max_train_steps", type=int, default=None)
    g.add_argument("--gradient_accumulation_steps", type=int, default=1,
                   help="Samples per optimizer step (upstream's cadence: one step per GA samples).")
    g.add_argument("--learning_rate", type=float, default=1e-4)
    g.add_argument("--lr_warmup_steps", type=int, default=10)
    g.add_argument("--max_grad_norm", type=float, default=2.0)
    g.add_argument("--gradient_checkpointing", action="store_true")
    g.add_argument("--selective_checkpointing", type=float, default=1.0,
                   help="Fraction p of transformer blocks recomputed with --gradient_checkpointing, spread "
                        "through the stack as upstream (p 0.5: every second block).")
    g.add_argument("--allow_tf32", action="store_true")
    g.add_argument("--mixed_precision", choices=PRECISIONS, default=None,
                   help="What the transformer computes in (rollout, update, JAGG's monitor, evaluation's decode). "
                        "Default: bf16 autocast on GPU (upstream's recipes), float32 on CPU. bf16 on CPU: "
                        "torch.autocast('cpu', bfloat16), a GPU's numerics class (bf16 matmuls, float32 "
                        "accumulation); fp16: GPU only; no: float32. The banner says which a run computes in.")
    g.add_argument("--use_cpu_offload", action="store_true", help="FSDP parameter offload to CPU.")
    g.add_argument("--sp_size", type=int, default=1, help="Sequence parallelism: only 1 is supported.")
    g.add_argument("--train_sp_batch_size", type=int, default=1, help=NOOP)
    g.add_argument("--fsdp_sharding_startegy", "--fsdp_sharding_strategy", dest="fsdp_sharding_startegy",
                   choices=SHARDING_STRATEGIES, default="full", help="(upstream's spelling kept)")
    g.add_argument("--lr_scheduler", type=str, default="constant_with_warmup")
    g.add_argument("--lr_num_cycles", type=int, default=1)
    g.add_argument("--lr_power", type=float, default=1.0)
    g.add_argument("--weight_decay", type=float, default=0.01)
    g.add_argument("--master_weight_type", choices=WEIGHT_TYPES, default=None,
                   help="FSDP MixedPrecision dtype of parameters in forward/backward, gradient reduction "
                        "and buffers (upstream's flag). Default: upstream's per model on GPU and on a CPU run "
                        "with --mixed_precision bf16 (Flux fp32 with bf16 autocast, Qwen-Image bf16; gloo "
                        "reduces bf16); fp32 on a float32 CPU run.")

    g = p.add_argument_group("GRPO")
    g.add_argument("--h", type=int, default=None, help="Image height (px, multiple of 16).")
    g.add_argument("--w", type=int, default=None, help="Image width (px, multiple of 16).")
    g.add_argument("--t", type=int, default=None, help=NOOP)
    g.add_argument("--sampling_steps", type=int, default=None, help="S, denoising steps of a rollout.")
    g.add_argument("--eta", type=float, default=None, help="SDE noise level (> 0).")
    g.add_argument("--sampler_seed", type=int, default=None, help="Prompt sampler seed (default: --seed).")
    g.add_argument("--loss_coef", type=float, default=1.0, help=NOOP)
    g.add_argument("--use_group", **bool_flag, help="Group-normalised advantages over --num_generations.")
    g.add_argument("--num_generations", type=int, default=16)
    g.add_argument("--use_hpsv2", **bool_flag, help="Same as --reward hpsv2=1.")
    g.add_argument("--use_pickscore", **bool_flag, help="Same as --reward pickscore=1.")
    g.add_argument("--ignore_last", **bool_flag, help="The last transition is always dropped. " + NOOP)
    g.add_argument("--init_same_noise", **bool_flag, help="Same initial noise within each prompt's group.")
    g.add_argument("--shift", type=float, default=1.0)
    g.add_argument("--timestep_fraction", type=float, default=1.0,
                   help="Fraction of the S-1 transitions trained per sample, in (0, 1].")
    g.add_argument("--clip_range", type=float, default=1e-4)
    g.add_argument("--adv_clip_max", type=float, default=5.0)
    g.add_argument("--use_ema", **bool_flag)

    g = p.add_argument_group("batching and controls (this project)")
    g.add_argument("--sample_batch_size", type=int, default=1,
                   help="Samples per transformer call in the rollout (upstream: 1).")
    g.add_argument("--update_batch_size", type=int, default=1,
                   help="Samples per transformer call in the policy update (upstream: 1); the gradient "
                        "is the same, only the batching changes.")
    g.add_argument("--shuffle_advantages", **bool_flag,
                   help="Control run: randomly permute the advantages over the step's samples.")
    add_flow_grpo_args(p)
    add_lora_args(p)
    add_engine_args(p)
    add_reward_args(p)
    p.set_defaults(family=family)
    return p


def _preset_from(argv, family):
    """The preset and cache folder named on the command line, before the full parse."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset", default=None)
    pre.add_argument("--cache_dir", default="./cache_dir")
    known, _ = pre.parse_known_args(argv)
    return known.preset, known.cache_dir


_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)


def join_negative_values(argv):
    """['--learning_rate', '-1e-3'] -> ['--learning_rate=-1e-3']: argparse reads '-1e-3' as a flag."""
    out = []
    for tok in argv:
        if out and _NEGATIVE_NUMBER.match(tok) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def explicit_flags(parser, argv):
    """The dests of the flags written on the command line (a resume keeps the checkpoint's seed
    unless --seed is among them)."""
    return sorted(typed_flags(parser, argv))


def check_preset_world(parser, argv, preset):
    """Refuse, before the preset is built, a world size its batch does not split over, unless the
    batch and accumulation are given by hand."""
    from .utils.launch import launch_world_size
    given = explicit_flags(parser, argv)
    problem = presets.uneven_split(parser.get_default("family"), preset, launch_world_size())
    if problem and not {"train_batch_size", "gradient_accumulation_steps"} <= set(given):
        parser.error(problem)


def parse_args(parser, argv=None):
    """Parse with preset defaults applied under explicit flags, then validate."""
    argv = join_negative_values(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)   # --help and flag errors answer here, before a preset is built
    preset, cache_dir = _preset_from(argv, parser.get_default("family"))
    if preset is not None:
        check_preset_world(parser, argv, preset)
        parser.set_defaults(**presets.preset_defaults(parser.get_default("family"), preset, cache_dir))
        args = parser.parse_args(argv)
    args.explicit_flags = explicit_flags(parser, argv)
    args.typed_flags = typed_flags(parser, argv)
    try:
        validate_args(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def add_flow_grpo_args(p):
    g = p.add_argument_group("Flow-GRPO / Flow-GRPO-Fast (this project; docs/flow_grpo_fast.md)")
    g.add_argument("--sde_type", choices=SDE_TYPES, default="dance",
                   help="Transition kernel; --eta is its noise level a. dance: DanceGRPO's flux_step; flow_grpo: "
                        "Flow-GRPO's sde (g = a sqrt(sigma / (1 - sigma))); cps: the coefficient-preserving kernel "
                        "(unscaled log-prob).")
    g.add_argument("--sde_window_size", type=int, default=0,
                   help="K > 0: Flow-GRPO-Fast. Per sampling batch, K consecutive transitions (the window) use "
                        "the SDE and the rest deterministic Euler; exactly the window is trained "
                        "(--timestep_fraction is ignored). 0: the SDE everywhere.")
    g.add_argument("--sde_window_range", type=int, nargs=2, default=None, metavar=("A", "B"),
                   help="The window's first transition is drawn uniformly in [A, B-K] (default 0 S-1).")
    g.add_argument("--kl_beta", type=float, default=0.0,
                   help="Weight of Flow-GRPO's KL term to the reference policy (the base weights: LoRA's disabled "
                        "adapter, else a frozen copy); 0: none.")
    g.add_argument("--advantage", choices=ADVANTAGE_RULES, default="dance",
                   help="dance: --use_group's (r - mean) / (std + 1e-8), unbiased std; flow_grpo: per-prompt mean, "
                        "population std (+1e-4), per prompt or with --global_std over every rank's rewards.")
    g.add_argument("--global_std", action=argparse.BooleanOptionalAction, default=False, help="With --advantage flow_grpo: one std over all rewards.")


def validate_flow_grpo_args(args):
    size = args.sde_window_size
    if size < 0:
        raise ValueError(f"--sde_window_size must be >= 0 (0: no window), got {size}")
    if args.sde_window_range is None:
        args.sde_window_range = [0, args.sampling_steps - 1]
    low, high = args.sde_window_range
    if size and not (0 <= low and high <= args.sampling_steps - 1 and high - low >= size):
        raise ValueError(f"--sde_window_range {low} {high} must hold a window of {size} inside the "
                         f"{args.sampling_steps - 1} trainable transitions: 0 <= A, B <= S-1, B - A >= K")
    if args.kl_beta < 0:
        raise ValueError(f"--kl_beta must be >= 0, got {args.kl_beta}")
    if args.advantage == "flow_grpo" and not args.use_group:
        raise ValueError("--advantage flow_grpo normalises per prompt: add --use_group (prompts x --num_generations)")


def validate_args(args):
    """Reject bad flags with a message that names the fix."""
    if args.sampling_steps is None or args.sampling_steps < 2:
        raise ValueError("--sampling_steps must be >= 2 (upstream scripts use 16 or 20)")
    if args.eta is None or args.eta <= 0:
        raise ValueError("--eta must be > 0: the SDE log-prob needs noise (upstream scripts use 0.3)")
    if not 0.0 < args.timestep_fraction <= 1.0:
        raise ValueError(f"--timestep_fraction must be in (0, 1], got {args.timestep_fraction}")
    if int((args.sampling_steps - 1) * args.timestep_fraction) < 1:
        raise ValueError("--timestep_fraction x (sampling_steps - 1) trains no transition; raise either")
    for name in ("h", "w"):
        v = getattr(args, name)
        if v is None or v <= 0 or v % 16:
            raise ValueError(f"--{name} must be a positive multiple of 16 (got {v})")
    for name in ("train_batch_size", "num_generations", "gradient_accumulation_steps",
                 "sample_batch_size", "update_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1")
    if args.max_train_steps is None or args.max_train_steps < 1:
        raise ValueError("--max_train_steps must be >= 1")
    if args.sample_every < 0:
        raise ValueError("--sample_every must be >= 0 (0: no sample grids)")
    if args.checkpointing_steps < 1:
        raise ValueError("--checkpointing_steps must be >= 1")
    if args.checkpoints_total_limit is not None and args.checkpoints_total_limit < 1:
        raise ValueError("--checkpoints_total_limit must be >= 1 (omit it to keep every checkpoint)")
    if not args.learning_rate > 0 or args.learning_rate == float("inf"):
        raise ValueError(f"--learning_rate must be a positive number, got {args.learning_rate} "
                         "(upstream scripts use 1e-5)")
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        raise ValueError(f"--max_grad_norm must be > 0, got {args.max_grad_norm}")
    if args.clip_range <= 0 or args.adv_clip_max <= 0:
        raise ValueError("--clip_range and --adv_clip_max must be > 0")
    if not 0.0 <= args.selective_checkpointing <= 1.0:
        raise ValueError("--selective_checkpointing must be in [0, 1]")
    if args.sp_size != 1:
        raise ValueError("--sp_size > 1 (sequence parallelism) is not supported; use data parallel ranks")
    if args.output_dir is None:
        raise ValueError("--output_dir is required (metrics, reward.txt and checkpoints go there)")
    from .utils.precision import check_precision   # torch: the parse is done, flag errors answered
    check_precision(args.mixed_precision)
    if args.use_group and args.num_generations < 2:
        raise ValueError("--use_group needs --num_generations >= 2")
    per_rank = args.train_batch_size * (args.num_generations if args.use_group else 1)
    if args.gradient_accumulation_steps > per_rank:
        # the optimizer steps once per GA samples, the loss divided by GA: fewer samples would train
        # on a loss scaled down by per_rank / GA (upstream's own step fails on it instead)
        raise ValueError(f"--gradient_accumulation_steps {args.gradient_accumulation_steps} exceeds the {per_rank} "
                         "samples a rank trains per step (--train_batch_size x --num_generations with --use_group): "
                         "the loss would be scaled down by their ratio; lower it to at most "
                         f"{per_rank}")
    validate_flow_grpo_args(args)
    validate_lora_args(args)
    validate_engine_args(args)
    args.reward_terms = resolve_reward_spec(args)
    check_reward_prompts(args.reward_terms, lambda: read_captions(args.data_json_path), args.data_json_path)


def read_captions(json_path):
    """The prompts of the data JSON, or None when it cannot be read (the dataset's own checks say why)."""
    try:
        with open(json_path) as f:
            items = json.load(f)
        return [item["caption"] for item in items]
    except (OSError, TypeError, ValueError, KeyError):
        return None
