"""What makes a trained flow model less linear along its trajectory: one factor at a time.

    python benchmarks/linearity_factors.py --family flux --out runs/factors [--factors base,depth,...]
        [--steps N] [--windows 4] [--groupings window,trained] [--rollouts 3] [--samples 32]

For each factor, the digits world's transformer is trained again (the build's own flow-matching
loop, dancegrpo.digits.build.train_transformer, seed 0, on the shipped digits VAE's latents and the
shipped prompt embeddings) with that one factor changed, saved beside copies of the shipped vae/ and
data/, and measured with jagg_patch.tools.fidelity at upstream's geometry (S 16 Flux / 20 Qwen-Image,
timestep_fraction 0.6, shift 3): cos(JAGG group gradient, exact) per position, the endpoints ablation
beside. Also the held-out correct-class rate of its ODE samples (100, the build's measure).
Writes factors.json, factors.md (one table per window and grouping) and factors.png (cos per
position, one line per factor) under --out; a factor already measured there is read back, not rerun.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# factor -> (what changes, transformer config overrides, world overrides, extra init gains
# {module-name suffixes: gain}, training steps multiplier). Configs are per family where they differ.
FACTORS = {
    "base": ("the shipped digits configuration, trained again", {}, {}, {}, 1),
    "long": ("4x the training steps", {}, {}, {}, 4),
    "width": ("head dim 32 (2x width)", dict(flux=dict(attention_head_dim=32, axes_dims_rope=(8, 8, 16)),
                                              qwenimage=dict(attention_head_dim=32, axes_dims_rope=(8, 8, 16))), {}, {}, 1),
    "heads": ("8 attention heads (2x width)", dict(flux=dict(num_attention_heads=8), qwenimage=dict(num_attention_heads=8)),
              {}, {}, 1),
    "depth": ("3x the blocks", dict(flux=dict(num_layers=2, num_single_layers=4), qwenimage=dict(num_layers=6)), {}, {}, 1),
    "mlp_gain": ("MLP input projections initialised 4x", {}, dict(mlp_gain=4.0), {}, 1),
    "qk_gain": ("query / key RMSNorm weights initialised 4x (sharper attention)", {}, {},
                {("norm_q", "norm_k", "norm_added_q", "norm_added_k"): 4.0}, 1),
    "temb_gain": ("timestep-embedding input layer initialised 4x (stronger t dependence)", {}, {},
                  {("timestep_embedder.linear_1",): 4.0}, 1),
    "large": ("digits_large: depth and MLP gain 4x", None, None, {}, 1),
}
MLP_INPUTS = dict(flux=("ff.net.0.proj", "ff_context.net.0.proj", "proj_mlp"),
                  qwenimage=("img_mlp.net.0.proj", "txt_mlp.net.0.proj"))


def factor_world(family, factor):
    """The digits build spec with the factor applied (the large world for `large`)."""
    from dancegrpo.digits.build import digits_world
    _, config, world_changes, _, _ = FACTORS[factor]
    if config is None:
        return digits_world(family, "digits_large")
    world = digits_world(family)
    cls, base = world.transformer
    world.transformer = (cls, dict(base, **config.get(family, {})))
    if world_changes:
        world.mlp_gain, world.mlp_inputs = world_changes["mlp_gain"], MLP_INPUTS[family]
    return world


def scale_init(transformer, gains):
    with torch.no_grad():
        for suffixes, gain in gains.items():
            modules = [m for n, m in transformer.named_modules() if n.endswith(suffixes) and getattr(m, "weight", None) is not None]
            if not modules:
                raise SystemExit(f"error: no module ends with {suffixes}")
            for m in modules:
                m.weight.mul_(gain)


def training_steps(world, factor, steps=None):
    """The factor's training length: --steps (default: the world's own, as its build trains it; 700
    for Qwen-Image's digits_large) times the factor's multiplier."""
    return (world.transformer_steps if steps is None else steps) * FACTORS[factor][4]


def train_factor(family_name, factor, folder, steps=None):
    """Train the factor's transformer on the shipped world's latents and embeddings; write the model
    folder; return (parameters, training seconds, held-out ODE rate)."""
    import diffusers
    from dancegrpo.digits import build as B
    from dancegrpo.digits import data
    from dancegrpo.presets import materialize_preset
    shipped = materialize_preset(family_name, "digits", "")
    world = factor_world(family_name, factor)
    for part in ("vae", "data"):
        if not os.path.isdir(os.path.join(folder, part)):
            shutil.copytree(os.path.join(shipped, part), os.path.join(folder, part))
    vae = getattr(diffusers, world.vae[0]).from_pretrained(os.path.join(shipped, "vae"))
    (x, y), _ = data.load_split()
    with torch.no_grad():
        pixels = world.vae_input(B.pixels(x))
        z = torch.cat([vae.encode(pixels[i:i + 256]).latent_dist.mode() for i in range(0, len(pixels), 256)])
    latents = world.normalise(vae, z)   # the same training latents the build measured its normalisation on
    embeds = world.embeddings(1, [p for p, _ in data.all_prompts()])   # the build's seed + 1
    family = world.family(SimpleNamespace(h=B.SIZE, w=B.SIZE, guidance=3.5))
    torch.manual_seed(0)
    transformer = B.make_transformer(world)
    scale_init(transformer, FACTORS[factor][3])
    t0 = time.time()
    transformer = B.train_transformer(world, family, latents, y, embeds, training_steps(world, factor, steps),
                                      torch.Generator().manual_seed(0), transformer=transformer)
    seconds = time.time() - t0
    transformer.save_pretrained(os.path.join(folder, "transformer"))
    rate = B.correct_class_rate(family, transformer, vae, embeds, n=100)
    return sum(p.numel() for p in transformer.parameters()), seconds, rate


def fidelity(family, folder, window, grouping, rollouts, samples):
    """jagg_patch.tools.fidelity on the folder's model at upstream's geometry -> its averaged rows."""
    module = {"flux": "dancegrpo.train_grpo_flux", "qwenimage": "dancegrpo.train_grpo_qwenimage"}[family]
    out = os.path.join(folder, f"fidelity_{grouping}_w{window}")
    cmd = [sys.executable, "-m", "jagg_patch.tools.fidelity", module, "--preset", "digits",
           "--pretrained_model_name_or_path", folder, "--data_json_path", os.path.join(folder, "data", "prompts.json"),
           "--output_dir", os.path.join(folder, "run"), "--jagg_window", str(window), "--jagg_grouping", grouping,
           "--fid_rollouts", str(rollouts), "--diag_samples", str(samples),
           "--sampling_steps", str({"flux": 16, "qwenimage": 20}[family]), "--timestep_fraction", "0.6",
           "--fid_out", out]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: fidelity failed for {folder}:\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "fidelity.json")) as f:
        return [dict(position=r["group"], mean_t=r["mean_t"], cos=r["cos_jagg_mean"], cos_index=r["cos_jagg_index_mean"],
                     cos_endpoints=r["cos_endpoints_mean"]) for r in json.load(f)["groups"]]


def markdown(results, family):
    lines = [f"# Linearity factors, {family}", ""]
    keys = sorted({k for r in results.values() for k in r["fidelity"]})
    for key in keys:
        width = max(len(r["fidelity"][key]) for r in results.values() if key in r["fidelity"])
        lines += [f"## {key} (cos(JAGG timestep alpha, exact) per position; endpoints ablation in brackets)", "",
                  "| factor | change | params | held-out rate | " + " | ".join(f"position {i}" for i in range(width)) + " |",
                  "|---|---|---|---|" + "---|" * width]
        for name, r in results.items():
            rows = r["fidelity"].get(key, [])
            cells = [f"{x['cos']:.4f} ({x['cos_endpoints']:.2f})" for x in rows] + ["-"] * (width - len(rows))
            lines.append(f"| {name} | {FACTORS[name][0]} | {r['params'] / 1e6:.2f}M | {r['rate']:.2f} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(path, results, family):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from dancegrpo.utils.plots import save_figure
    keys = sorted({k for r in results.values() for k in r["fidelity"]})
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for i, (name, r) in enumerate(results.items()):
            rows = r["fidelity"].get(key, [])
            if rows:   # one colour per factor across the panels (20 before a colour repeats)
                ax.plot([x["position"] for x in rows], [x["cos"] for x in rows], marker="o",
                        color=plt.cm.tab20(i % 20), label=name)
        ax.set_title(f"{family}, {key}")
        ax.set_xlabel("position (0 = highest noise)")
        ax.set_ylabel("cos(JAGG, exact)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    save_figure(fig, path)


def main(argv=None):
    from dancegrpo.utils.command_line import CommandParser
    p = CommandParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=("flux", "qwenimage"), default="flux")
    p.add_argument("--factors", default=",".join(FACTORS))
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per factor (x the factor's multiplier); default: the world's own")
    p.add_argument("--windows", default="4")
    p.add_argument("--groupings", default="window,trained")
    # 3 x 32, as the digits world's fidelity tables: the group gradient is a sum over the samples,
    # and with 2 x 8 the lowest-noise window of one model read 0.959 where 3 x 32 reads 0.998.
    p.add_argument("--rollouts", type=int, default=3)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    factors = args.factors.split(",")
    unknown = [f for f in factors if f not in FACTORS]
    if unknown:
        raise SystemExit(f"error: unknown factor(s) {unknown}; choose from {list(FACTORS)}")
    out = os.path.join(args.out, args.family)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "factors.json")
    results = json.load(open(path)) if os.path.isfile(path) else {}
    for factor in factors:
        folder = os.path.join(out, factor)
        if factor not in results:
            os.makedirs(folder, exist_ok=True)
            params, seconds, rate = train_factor(args.family, factor, folder, args.steps)
            results[factor] = dict(params=params, train_s=round(seconds, 1), rate=rate, fidelity={})
        for window in map(int, args.windows.split(",")):
            for grouping in args.groupings.split(","):
                key = f"W {window}, grouping {grouping}, {args.rollouts} x {args.samples} samples"
                if key not in results[factor]["fidelity"]:
                    results[factor]["fidelity"][key] = fidelity(args.family, folder, window, grouping, args.rollouts,
                                                                args.samples)
        print(f"{factor}: {results[factor]['params'] / 1e6:.2f}M params, rate {results[factor]['rate']:.2f}, "
              + "; ".join(f"{k}: " + " ".join(f"{x['cos']:.4f}" for x in v) for k, v in results[factor]["fidelity"].items()),
              flush=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    with open(os.path.join(out, "factors.md"), "w") as f:
        f.write(markdown(results, args.family))
    plot(os.path.join(out, "factors.png"), results, args.family)
    print(f"wrote {out}/factors.md and factors.png")


if __name__ == "__main__":
    main()
