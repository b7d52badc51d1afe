"""Evaluate checkpoints: generate images for a prompt set, score them, write a comparison table.

    python -m dancegrpo.evaluate --preset tiny --metrics jpeg --output_dir runs/eval
    python -m dancegrpo.evaluate --pretrained_model_name_or_path data/flux \\
        --data_json_path data/rl_embeddings/videos2caption.json --prompt_file prompts.txt \\
        --checkpoint vanilla=data/flux --checkpoint jagg=out/jagg/checkpoint-300-0 \\
        --metrics hpsv2,pickscore,clipscore --hps_ckpt_dir ./hps_ckpt ... --output_dir runs/eval

Each --checkpoint is `[LABEL=]PATH`, PATH being a transformer folder written by the trainer
(config.json + diffusion_pytorch_model.safetensors, also its ema/ sub-folder) or a base model
folder with transformer/. Without --checkpoint the base model's (or preset's) transformer is
evaluated. The VAE comes from --vae_model_path or --pretrained_model_name_or_path (vae/).

Prompts: the model needs precomputed embeddings, so prompts come from --data_json_path (the
trainer's layout; the preset's JSON with --preset). --prompt_file (one prompt per line, blank
lines skipped) selects and orders prompts by exact caption match against that JSON.

Sampling: the trainer's schedule (sd3_time_shift, int(sigma*1000)/1000 timesteps) and model code.
Default is the deterministic ODE (Euler: x + dsigma * v); --sde uses the trainer's SDE transition
(flux_step with sde_solver, noise scale --eta). The decoded image is the last step's x0 estimate,
as in training. Every image has its own seed, (seed * 1000003 + prompt_index) * 1009 + image_index,
drawn on the CPU: the same prompt gets the same noise for every checkpoint and batch size
(other batch sizes give the same images up to float rounding; same settings are bit-exact).

Outputs under --output_dir: <label>/scores.csv (one row per image: prompt, seed, one column per
metric), <label>/summary.json, <label>/grid.png (rows = prompts, columns = images), and
table.md / comparison.json over all checkpoints; the markdown table is also printed. The folder
is locked while an evaluation writes it (a second one there is refused), and a later evaluation of
the same metrics and sampling settings adds its rows to table.md / comparison.json (a label
evaluated again replaces its row); one of other metrics, or of another sampler, eta, step count,
shift, guidance, size, precision, seed, images per prompt or prompt set, is refused before any
model loads (its rows would differ by their settings alone). table.md ends with those settings. The
generation and scoring are dancegrpo.eval_run's, loaded once the command line is answered.
"""
import argparse
import contextlib
import os

from . import presets
from .choices import PRECISIONS
from .errors import is_disk_full, say
from .eval_inputs import EvalError, parse_checkpoints
from .models.registry import family_names
from .rewards import RewardNotFiniteError, add_reward_args, parse_reward_spec
from .run.readers import ReaderLock, run_folder_of
from .utils.command_line import CommandParser

DEFAULTS = dict(h=720, w=720, sampling_steps=16, shift=3.0, eta=0.3)  # upstream's Flux training geometry


def build_parser():
    p = CommandParser(prog="python -m dancegrpo.evaluate", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=family_names(), default="flux")
    p.add_argument("--preset", default=None, help="Embedded model + prompt data (e.g. 'tiny'); sets defaults.")
    p.add_argument("--cache_dir", default="./cache_dir", help="Where presets are built.")
    p.add_argument("--checkpoint", action="append", default=[], metavar="[LABEL=]PATH",
                   help="Transformer to evaluate (repeatable; one table row each).")
    p.add_argument("--pretrained_model_name_or_path", default=None,
                   help="Base model folder (vae/, and transformer/ when no --checkpoint is given).")
    p.add_argument("--vae_model_path", default=None, help="Folder holding vae/ if it differs.")
    p.add_argument("--data_json_path", default=None, help="Prompt embeddings in the trainer's layout.")
    p.add_argument("--prompt_file", default=None, help="Prompts to evaluate, one per line (matched by caption).")
    p.add_argument("--max_prompts", type=int, default=None, help="Evaluate only the first N prompts.")
    p.add_argument("--num_images_per_prompt", type=int, default=1)
    p.add_argument("--metrics", default=None,
                   help="Comma list of reward names to report, e.g. 'hpsv2,pickscore,clipscore' (default: the "
                        "preset's reward, else hpsv2).")
    p.add_argument("--h", type=int, default=None, help="Image height (multiple of 16; default 720 or the preset's).")
    p.add_argument("--w", type=int, default=None, help="Image width.")
    p.add_argument("--sampling_steps", type=int, default=None, help="Denoising steps (default 16 or the preset's).")
    p.add_argument("--shift", type=float, default=None, help="Time shift (default 3 or the preset's).")
    p.add_argument("--guidance", type=float, default=3.5, help="Distilled guidance (Flux-dev).")
    p.add_argument("--sde", action="store_true", help="Sample with the SDE (noise --eta) instead of the ODE.")
    p.add_argument("--mixed_precision", choices=PRECISIONS, default=None,
                   help="What the transformer computes in, as the trainer's flag: default bf16 autocast on GPU, "
                        "float32 on CPU; bf16 on CPU runs CPU autocast (and decodes under it).")
    p.add_argument("--eta", type=float, default=None, help="SDE noise level (with --sde).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=4, help="Images per transformer call and reward call.")
    p.add_argument("--device", default=None, help="Default: cuda if available, else cpu.")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--save_images", action="store_true", help="Also write every image as PNG.")
    p.add_argument("--grid_max_prompts", type=int, default=8)
    p.add_argument("--grid_tile", type=int, default=256, help="Longest side of a grid tile (px).")
    add_reward_args(p)
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    try:
        finish_args(args)
    except EvalError as e:
        p.error(str(e))
    return args


def finish_args(args):
    """Apply preset / default values and validate."""
    if args.preset is not None:
        if args.preset not in presets.preset_names(args.family):
            raise EvalError(f"--preset {args.preset!r} does not exist for {args.family}; available: "
                            f"{presets.preset_names(args.family)}")
        root = presets.materialize_preset(args.family, args.preset, args.cache_dir)
        spec = presets.preset_spec(args.family, args.preset)["defaults"]
        for k in DEFAULTS:
            if getattr(args, k) is None:
                setattr(args, k, spec[k])
        args.pretrained_model_name_or_path = args.pretrained_model_name_or_path or root
        args.data_json_path = args.data_json_path or os.path.join(root, "data", "prompts.json")
        args.metrics = args.metrics or spec.get("reward", "jpeg")
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.metrics = args.metrics or "hpsv2"
    try:
        args.metric_terms = [(name, 1.0) for name, _ in parse_reward_spec(args.metrics)]
    except ValueError as e:
        raise EvalError(f"--metrics: {e}") from None
    for name in ("h", "w"):
        v = getattr(args, name)
        if v <= 0 or v % 16:
            raise EvalError(f"--{name} must be a positive multiple of 16 (got {v})")
    for name in ("sampling_steps", "num_images_per_prompt", "batch_size", "grid_max_prompts", "grid_tile"):
        if getattr(args, name) < 1:
            raise EvalError(f"--{name} must be >= 1")
    from .utils.precision import check_precision   # torch, once the flags have parsed
    try:
        check_precision(args.mixed_precision, None if args.device is None else args.device.startswith("cuda"))
    except ValueError as e:
        raise EvalError(str(e)) from None
    if args.sde and args.eta <= 0:
        raise EvalError("--sde needs --eta > 0 (upstream trains with 0.3)")
    if args.max_prompts is not None and args.max_prompts < 1:
        raise EvalError("--max_prompts must be >= 1")
    if not args.data_json_path:
        raise EvalError("--data_json_path is required (prompt embeddings from the preprocessing script), "
                        "or use --preset tiny")
    if not args.pretrained_model_name_or_path and not args.vae_model_path:
        raise EvalError("Pass --pretrained_model_name_or_path (the base model folder with vae/) or "
                        "--vae_model_path, or use --preset tiny")
    args.checkpoints = parse_checkpoints(args.checkpoint, args.pretrained_model_name_or_path, args.preset)
    return args


def hold_run_folders(checkpoints, stack):
    """A reader's lock on each run folder the checkpoints lie in (dancegrpo.run.readers), held until
    the evaluation ends: a run starting there with --overwrite_output_dir, or pruning with
    --checkpoints_total_limit, leaves them in place meanwhile."""
    for folder in sorted({run_folder_of(path) for _, path in checkpoints} - {None}):
        if not os.path.isdir(folder):
            continue   # run() names the missing checkpoint
        try:
            stack.enter_context(ReaderLock(folder, "dancegrpo.evaluate"))
        except OSError as e:   # a read-only copy of a run: nobody can delete there either
            say(f"notice: cannot mark {folder!r} as being read ({e.strerror}); a run started there could delete "
                "its checkpoints during the evaluation")


def main(argv=None):
    args = parse_args(argv)
    from .eval_run import run   # torch, diffusers and the reward models: once the command line is answered
    try:
        with contextlib.ExitStack() as stack:
            hold_run_folders(args.checkpoints, stack)
            return run(args, stack)
    except (EvalError, FileNotFoundError, ValueError, ImportError, RewardNotFiniteError) as e:
        say(f"error: {e}")
        raise SystemExit(2) from None
    except OSError as e:
        if not is_disk_full(e):
            raise
        say(f"stopped: no space left to write {e.filename or 'a file'} in {args.output_dir!r} ({e.strerror}); "
            "every file there is whole (each is written under a temporary name, then renamed), table.md "
            "lists the checkpoints scored before. Free space and run the evaluation again")
        raise SystemExit(3) from None


if __name__ == "__main__":
    main()
