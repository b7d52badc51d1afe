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
the same metrics adds its rows to table.md / comparison.json (a label evaluated again replaces its
row); one of other metrics is refused.
"""
import argparse
import contextlib
import csv
import errno
import json
import math
import os
import re
import sys
import time

import torch

from . import presets
from .algo.sampling import denoise, ode, sde_per_sample
from .algo.sde import model_timesteps, sigma_schedule
from .errors import ConfigError, NonFiniteError
from .eval_report import (earlier_summaries, merged_summaries, nonfinite_summary, table_header, table_row,
                          write_comparison)
from .utils.precision import CHOICES as PRECISIONS, check_precision, compute_autocast, describe_precision
from .models.checkpoints import load_transformer, load_vae, precheck_checkpoint
from .models.registry import family_class, family_names
from .run.finite import nonfinite_parameters
from .run.readers import ReaderLock, run_folder_of
from .run.rundir import RunLock
from .rewards import RewardNotFiniteError, WeightedReward, add_reward_args, parse_reward_spec
from .utils.atomic import write_atomically
from .utils.checkpoint import CONFIG_NAME
from .utils.samples import tile

DEFAULTS = dict(h=720, w=720, sampling_steps=16, shift=3.0, eta=0.3)  # upstream's Flux training geometry


class EvalError(ConfigError):
    """Bad input; the message names the fix."""


def build_parser():
    p = argparse.ArgumentParser(prog="python -m dancegrpo.evaluate", description=__doc__.split("\n\n")[0],
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


def parse_checkpoints(specs, base, preset):
    if not specs:
        if not base:
            raise EvalError("Nothing to evaluate: pass --checkpoint [LABEL=]PATH or --pretrained_model_name_or_path")
        return [(f"preset-{preset}" if preset else "base", base)]
    out = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or os.path.exists(spec):
            label, path = os.path.basename(os.path.normpath(spec)) or "checkpoint", spec
        out.append((label, path))
    labels = [lab for lab, _ in out]
    if len(set(labels)) != len(labels):
        raise EvalError(f"Checkpoint labels repeat ({labels}); name them with --checkpoint LABEL=PATH")
    return out


def safe_name(label):
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._") or "checkpoint"


# ------------------------------------------------------------------ prompts
def read_prompt_file(path):
    if not os.path.isfile(path):
        raise EvalError(f"--prompt_file {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise EvalError(f"--prompt_file {path!r} holds no prompts (one prompt per line; blank lines are skipped)")
    return prompts


def select_prompts(args, dataset):
    """Dataset indices of the prompts to evaluate, in order."""
    captions = [item["caption"] for item in dataset.items]
    if args.prompt_file:
        index = {}
        for i, c in enumerate(captions):
            index.setdefault(c.strip(), i)
        wanted = read_prompt_file(args.prompt_file)
        missing = [p for p in wanted if p not in index]
        if missing:
            raise EvalError(f"{len(missing)} of {len(wanted)} prompts in {args.prompt_file!r} have no embedding in "
                            f"{args.data_json_path!r} (e.g. {missing[:3]}). Embed the prompt file with the "
                            "preprocessing script and pass its JSON as --data_json_path.")
        chosen = [index[p] for p in wanted]
    else:
        chosen = list(range(len(captions)))
    return chosen[:args.max_prompts] if args.max_prompts else chosen


def sample_seed(seed, prompt_index, image_index):
    return ((seed * 1_000_003 + prompt_index) * 1009 + image_index) % 2 ** 63


# ------------------------------------------------------------------ generation and scoring
@torch.no_grad()
def generate(args, family, transformer, vae, cond, seeds, device):
    """Images for one batch: cond rows and per-image seeds. ODE by default, the trainer's SDE kernel
    (DanceGRPO's) with --sde, each image's noise from its own generator."""
    sigmas = sigma_schedule(args.sampling_steps, args.shift)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    z = torch.cat([family.initial_noise(1, g, device) for g in gens]).float()

    def predict(x, t):
        with compute_autocast(device, args.mixed_precision):
            return family.predict(transformer, x.to(transformer.dtype), t, cond).float()

    step = sde_per_sample("dance", args.eta, sigmas, gens) if args.sde else ode(sigmas)
    return family.decode(vae, denoise(predict, z, sigmas, model_timesteps(sigmas), step).x0)


def evaluate_checkpoint(args, family, transformer, vae, dataset, prompt_ids, metric_fn, label, path, device):
    out_dir = os.path.join(args.output_dir, safe_name(label))
    os.makedirs(out_dir, exist_ok=True)
    if args.save_images:
        os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    jobs = [(p, k) for p in range(len(prompt_ids)) for k in range(args.num_images_per_prompt)]
    names = [name for name, _ in args.metric_terms]
    rows, grid_images = [], []
    t_gen = t_score = 0.0
    for start in range(0, len(jobs), args.batch_size):
        batch = jobs[start:start + args.batch_size]
        items = [dataset[prompt_ids[p]] for p, _ in batch]
        cond = {key: torch.stack([it[key] for it in items]).to(device) for key in family.embedding_fields}
        cond = {k: v.to(transformer.dtype) if v.is_floating_point() else v for k, v in cond.items()}
        captions = [it["caption"] for it in items]
        seeds = [sample_seed(args.seed, p, k) for p, k in batch]
        t0 = time.time()
        images = generate(args, family, transformer, vae, cond, seeds, device)
        t1 = time.time()
        metric_fn(images, captions)
        t_score += time.time() - t1
        t_gen += t1 - t0
        for j, ((p, k), im) in enumerate(zip(batch, images)):
            row = {"prompt_index": p, "image_index": k, "seed": seeds[j], "prompt": captions[j]}
            row.update({n: float(metric_fn.last_terms[n][j]) for n in names})
            rows.append(row)
            if p < args.grid_max_prompts:
                grid_images.append(im)
            if args.save_images:
                write_atomically(os.path.join(out_dir, "images", f"p{p:04d}_i{k:02d}.png"), im.save)
    write_atomically(os.path.join(out_dir, "scores.csv"), lambda tmp: write_scores(tmp, rows))
    grid = tile(grid_images, args.num_images_per_prompt, max_side=args.grid_tile, background="white")
    write_atomically(os.path.join(out_dir, "grid.png"), grid.save)
    metrics = {}
    for n in names:
        vals = torch.tensor([r[n] for r in rows], dtype=torch.float64)
        std = vals.std().item() if vals.numel() > 1 else 0.0
        metrics[n] = {"mean": vals.mean().item(), "std": std, "sem": std / math.sqrt(vals.numel())}
    summary = {
        "label": label, "checkpoint": os.path.abspath(path), "family": args.family,
        "num_prompts": len(prompt_ids), "num_images": len(rows), "metrics": metrics,
        "sampler": "sde" if args.sde else "ode", "eta": args.eta if args.sde else None,
        "sampling_steps": args.sampling_steps, "shift": args.shift, "h": args.h, "w": args.w,
        "guidance": args.guidance, "seed": args.seed, "prompt_file": args.prompt_file,
        "data_json_path": os.path.abspath(args.data_json_path),
        "generate_time_s": t_gen, "score_time_s": t_score, "device": str(device),
        "precision": describe_precision(device, args.mixed_precision),
    }
    write_atomically(os.path.join(out_dir, "summary.json"), lambda tmp: _dump_json(summary, tmp))
    return summary


def write_scores(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()})


def _dump_json(obj, path):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def run(args, stack):
    """Check the input, claim the output folder (held on `stack`, a contextlib.ExitStack, until it
    closes), score every checkpoint, write the table. Returns this evaluation's summaries."""
    from .utils.data import PromptEmbeddingDataset
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    family_cls = family_class(args.family)
    transformer_cls, vae_cls = family_cls.transformer_class_name, family_cls.vae_class_name
    family = family_cls(args)
    try:
        dataset = PromptEmbeddingDataset(args.data_json_path, family.embedding_fields)
    except (FileNotFoundError, ValueError) as e:
        raise EvalError(str(e)) from None
    prompt_ids = select_prompts(args, dataset)
    for label, path in args.checkpoints:  # fail before any expensive work
        precheck_checkpoint(path, args.pretrained_model_name_or_path, transformer_cls)
        note = preset_mismatch(label, path, args.preset)
        if note:
            print(f"warning: {note}", file=sys.stderr, flush=True)
    names = [n for n, _ in args.metric_terms]
    os.makedirs(args.output_dir, exist_ok=True)
    lock = RunLock(args.output_dir, "dancegrpo.evaluate").acquire()   # one writer of table.md at a time
    stack.callback(lock.release)
    earlier = earlier_summaries(args.output_dir, names)
    vae = load_vae(vae_cls, args, device)
    metric_fn = WeightedReward(args.metric_terms, device, args)
    print(table_header(names), flush=True)
    summaries = []
    for label, path in args.checkpoints:
        transformer = load_transformer(transformer_cls, path, device, base=args.pretrained_model_name_or_path)
        try:
            bad = nonfinite_parameters(transformer)   # a diverged run's checkpoint
            if bad:
                raise NonFiniteError(f"{len(bad)} weight tensor(s) hold NaN/inf, e.g. {bad[0]}")
            summary = evaluate_checkpoint(args, family, transformer, vae, dataset, prompt_ids, metric_fn, label,
                                          path, device)
        except NonFiniteError as e:  # flagged, not ranked; the other checkpoints are still scored
            print(f"warning: {label}: {e}", file=sys.stderr, flush=True)
            summary = nonfinite_summary(label, path, names, str(e))
        del transformer
        summaries.append(summary)
        print(table_row(summary), flush=True)
    write_comparison(args.output_dir, names, merged_summaries(earlier, summaries))
    return summaries


def preset_mismatch(label, path, preset):
    """One line when the checkpoint's run (its run_config.json) trained on another preset than the one
    evaluated with: the prompts, geometry and reward then are not the ones it learned; None otherwise."""
    try:
        with open(os.path.join(path, CONFIG_NAME)) as f:
            trained = json.load(f).get("preset")
    except (OSError, ValueError):
        return None   # not a trainer checkpoint (a base model, an upstream checkpoint): nothing recorded
    if trained == preset:
        return None
    said = lambda name: f"--preset {name}" if name else "no preset"   # noqa: E731
    return (f"{label}: trained with {said(trained)} ({CONFIG_NAME}), evaluated with {said(preset)}: its prompts, "
            "geometry and reward may not be the ones it learned")


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
            print(f"notice: cannot mark {folder!r} as being read ({e.strerror}); a run started there could delete "
                  "its checkpoints during the evaluation", file=sys.stderr, flush=True)


def main(argv=None):
    args = parse_args(argv)
    try:
        with contextlib.ExitStack() as stack:
            hold_run_folders(args.checkpoints, stack)
            return run(args, stack)
    except (EvalError, FileNotFoundError, ValueError, ImportError, RewardNotFiniteError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"stopped: no space left to write {e.filename or 'a file'} in {args.output_dir!r} ({e.strerror}); "
              "every file there is whole (each is written under a temporary name, then renamed), table.md "
              "lists the checkpoints scored before. Free space and run the evaluation again", file=sys.stderr)
        raise SystemExit(3) from None


if __name__ == "__main__":
    main()
