"""The evaluation itself (dancegrpo.evaluate parses and checks the command line): the prompts, the
seeded images of each checkpoint, their scores, and the files and table they go to."""
import csv
import json
import math
import os
import time

import torch

from .algo.sampling import denoise, ode, sde_per_sample
from .algo.sde import model_timesteps, sigma_schedule
from .errors import NonFiniteError, say
from .eval_report import (earlier_summaries, eval_settings, merged_summaries, nonfinite_summary,
                          settings_line, table_header, table_row, write_comparison)
from .eval_inputs import EvalError, preset_mismatch, read_prompt_file, safe_name
from .eval_models import load_transformer, load_vae, precheck_checkpoint
from .models.registry import family_class
from .rewards import WeightedReward
from .run.finite import nonfinite_parameters
from .run.rundir import RunLock
from .utils.atomic import write_atomically, write_text
from .utils.precision import compute_autocast, describe_precision
from .samples import tile


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


def evaluate_checkpoint(args, family, transformer, vae, dataset, prompt_ids, metric_fn, label, path, device,
                        settings):
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
        "label": label, "checkpoint": os.path.abspath(path), "num_prompts": len(prompt_ids), "num_images": len(rows),
        "metrics": metrics, **settings, "prompt_file": args.prompt_file,
        "data_json_path": os.path.abspath(args.data_json_path),
        "generate_time_s": t_gen, "score_time_s": t_score, "device": str(device),
    }
    write_text(os.path.join(out_dir, "summary.json"), json.dumps(summary, indent=1))
    return summary


def write_scores(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()})


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
            say(f"warning: {note}")
    names = [n for n, _ in args.metric_terms]
    settings = eval_settings(args, [dataset.items[i]["caption"] for i in prompt_ids],
                             describe_precision(device, args.mixed_precision))
    os.makedirs(args.output_dir, exist_ok=True)
    lock = RunLock(args.output_dir, "dancegrpo.evaluate").acquire()   # one writer of table.md at a time
    stack.callback(lock.release)
    earlier = earlier_summaries(args.output_dir, names, settings)
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
                                          path, device, settings)
        except NonFiniteError as e:  # flagged, not ranked; the other checkpoints are still scored
            say(f"warning: {label}: {e}")
            summary = nonfinite_summary(label, path, names, str(e), settings)
        del transformer
        summaries.append(summary)
        print(table_row(summary), flush=True)
    print(settings_line(settings), flush=True)
    write_comparison(args.output_dir, names, merged_summaries(earlier, summaries))
    return summaries
