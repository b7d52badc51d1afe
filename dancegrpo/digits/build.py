"""Build the digits world's models from the data, deterministically:
`python -m dancegrpo.digits.build --family flux|qwenimage [--world digits|digits_large] --out DIR`.

1. the family's VAE, trained to reconstruct the rendered training digits; its latent shift and
   scale are measured on them and written into its config, where the family's decode reads them;
2. fixed prompt embeddings (seeded random tensors, one set per prompt) in the family's upstream
   file layout, so the trainer reads them like real preprocessed prompts;
3. the family's transformer, trained by flow matching on the VAE latents, conditioned on those
   embeddings through the same `predict` call the GRPO trainer makes;
4. a measurement: the held-out correct-class rate (`digit_heldout`) of samples from fixed noise.

DIR then holds transformer/, vae/ (diffusers folders), data/prompts.json with its embedding
files, and BUILD.json (settings, times, rates). The transformer is stopped early on purpose: it
follows prompts only partly, so GRPO has work to do.
"""
import json
import os
import shutil
import time
from types import SimpleNamespace

import numpy as np
import torch

from ..errors import is_disk_full, say
from ..models.registry import family_names, family_part
from ..utils.command_line import CommandParser
from . import data

SIZE = 64


def world_names():
    """Every world some registered family builds (the CLI's choices; a family without one refuses it)."""
    return sorted({name for family in family_names() for name in family_part(family, "digits").WORLDS})


def digits_world(family_name, world="digits"):
    """The family's build spec of that world (its package's WORLDS, dancegrpo.models.registry)."""
    worlds = family_part(family_name, "digits").WORLDS
    if world not in worlds:
        raise ValueError(f"the {family_name} family has no {world!r} world; it has {sorted(worlds)}")
    return worlds[world]()


def make_transformer(world):
    """The world's transformer at initialisation: diffusers' own, then the MLP input projections
    named by the world scaled by its mlp_gain (a sharper nonlinearity of the latent; 1 leaves
    diffusers' initialisation as it is)."""
    import diffusers
    cls, config = world.transformer
    transformer = getattr(diffusers, cls)(**config)
    if world.mlp_gain != 1:
        scaled = [m for n, m in transformer.named_modules() if n.endswith(world.mlp_inputs)]
        if not scaled:
            raise ValueError(f"no module of {cls} ends with any of {world.mlp_inputs}: the world names the wrong "
                             "MLP projections")
        with torch.no_grad():
            for module in scaled:
                module.weight.mul_(world.mlp_gain)
    return transformer


def pixels(images):
    """Rendered digits as the VAE's input: [N, 3, SIZE, SIZE] in [-1, 1]."""
    arr = np.stack([np.asarray(im, dtype=np.float32) / 127.5 - 1 for im in data.render(images, SIZE)])
    return torch.from_numpy(arr.transpose(0, 3, 1, 2).copy())


def train_vae(world, x, steps, generator, batch=64, lr=2e-3, kl_weight=1e-4):
    """The family's VAE trained to reconstruct x; returns it (eval, frozen) with its latent
    normalisation written into its config, and the normalised training latents [N, C, h, w]."""
    import diffusers
    cls, config = world.vae
    vae = getattr(diffusers, cls)(**config)
    x = world.vae_input(x)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (batch,), generator=generator)
        posterior = vae.encode(x[idx]).latent_dist
        recon = vae.decode(posterior.sample(generator=generator)).sample
        # KL per latent element, lightly weighted: the latents stay near N(0, 1) without blurring.
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        loss = torch.nn.functional.mse_loss(recon, x[idx]) + kl_weight * kl
        opt.zero_grad()
        loss.backward()
        opt.step()
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        z = torch.cat([vae.encode(x[i:i + 256]).latent_dist.mode() for i in range(0, len(x), 256)])
    return vae, world.normalise(vae, z)


@torch.no_grad()
def reconstruction_mse(world, vae, x):
    """Mean squared error of encode (mode) -> decode on pixels in [-1, 1]."""
    x = world.vae_input(x)
    return float(sum(((vae.decode(vae.encode(x[i:i + 256]).latent_dist.mode()).sample - x[i:i + 256]) ** 2).sum()
                     for i in range(0, len(x), 256)) / x.numel())


def train_transformer(world, family, latents, labels, embeds, steps, generator, batch=128, lr=1e-3, transformer=None):
    """Rectified flow: x_s = (1 - s) x0 + s eps, target v = eps - x0 (so x0 = x_s - s v, as flux_step
    reads the model), s logit-normal. Trains `transformer` when given (an experiment's own
    initialisation), else the world's."""
    from ..models.base import pack_latents
    transformer = make_transformer(world) if transformer is None else transformer
    n, c, h, w = latents.shape
    tokens = pack_latents(latents, n, c, h, w)
    prompts_of = {d: data.prompts_for(d) for d in range(10)}
    opt = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        idx = torch.randint(0, n, (batch,), generator=generator)
        phrasing = torch.randint(0, len(data.PHRASINGS), (batch,), generator=generator)
        prompts = [prompts_of[int(labels[i])][int(k)] for i, k in zip(idx, phrasing)]
        x0, eps = tokens[idx], torch.randn(tokens[idx].shape, generator=generator)
        s = torch.sigmoid(torch.randn(batch, generator=generator))
        xs = (1 - s)[:, None, None] * x0 + s[:, None, None] * eps
        v = family.predict(transformer, xs, s, world.conditions(embeds, prompts))
        loss = torch.nn.functional.mse_loss(v, eps - x0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return transformer.eval().requires_grad_(False)


@torch.no_grad()
def correct_class_rate(family, transformer, vae, embeds, n=200, sampling_steps=8, shift=3.0, eta=0.0, seed=5):
    """Held-out correct-class rate of n samples from fixed noise, prompts cycling over digits and
    phrasings: Euler ODE (eta 0) or the trainer's SDE (eta > 0)."""
    from ..algo.sampling import denoise, ode, sde
    from ..algo.sde import model_timesteps, sigma_schedule
    from .classifiers import neighbours_classifier
    g = torch.Generator().manual_seed(seed)
    prompts = [data.prompts_for(i % 10)[(i // 10) % len(data.PHRASINGS)] for i in range(n)]
    cond = digits_world(family.name).conditions(embeds, prompts)
    sigmas = sigma_schedule(sampling_steps, shift)
    timesteps = model_timesteps(sigmas)
    z = family.initial_noise(n, g, torch.device("cpu"))
    step = sde("dance", eta, sigmas, g) if eta > 0 else ode(sigmas)
    x0 = denoise(lambda x, t: family.predict(transformer, x, t, cond), z, sigmas, timesteps, step).x0
    predicted = neighbours_classifier().predict(data.features(family.decode(vae, x0)))
    return float((predicted == [data.digit_of_prompt(p) for p in prompts]).mean())


def build(family_name, out, vae_steps=300, transformer_steps=None, seed=0, log=print, max_images=None,
          world_name="digits"):
    """Train the family's VAE and transformer of the world and write the model folder (transformer_steps:
    the world's own when None). `max_images` keeps the first images of each split and as many
    evaluation samples (at most the usual 200): a quick build whose numbers say nothing, for
    checking the path end to end."""
    world = digits_world(family_name, world_name)
    transformer_steps = world.transformer_steps if transformer_steps is None else transformer_steps
    staging = staging_folder(out)   # before the training: an --out that cannot be written fails at once
    try:
        record = _build(world, family_name, world_name, staging, vae_steps, transformer_steps, seed, log, max_images)
        replace_folder(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return record


def staging_folder(out):
    """A fresh folder beside `out`, where the build is written before it replaces `out` whole."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    staging = f"{os.path.abspath(out)}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def replace_folder(staging, out):
    """`out` becomes the complete `staging`; an earlier build there is kept until then, and removed after."""
    old = None
    if os.path.exists(out):
        old = f"{os.path.abspath(out)}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(staging, out)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _build(world, family_name, world_name, out, vae_steps, transformer_steps, seed, log, max_images):
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    (x, y), (test_x, _) = data.load_split()
    x, y, test_x = x[:max_images], y[:max_images], test_x[:max_images]
    eval_samples = min(200, max_images or 200)
    record = {"family": family_name, "world": world_name, "seed": seed, "size": SIZE, "vae_steps": vae_steps,
              "transformer_steps": transformer_steps, "torch": torch.__version__, "threads": torch.get_num_threads()}
    if world.mlp_gain != 1:
        record["mlp_gain"] = world.mlp_gain
    if max_images is not None:
        record["max_images"] = max_images
    t0 = time.time()
    vae, latents = train_vae(world, pixels(x), vae_steps, generator)
    record["vae_time_s"] = round(time.time() - t0, 1)
    record["vae_heldout_mse"] = round(reconstruction_mse(world, vae, pixels(test_x)), 5)
    log(f"vae: {vae_steps} steps in {record['vae_time_s']} s, held-out reconstruction MSE {record['vae_heldout_mse']}")
    embeds = world.embeddings(seed + 1, [p for p, _ in data.all_prompts()])
    family = world.family(SimpleNamespace(h=SIZE, w=SIZE, guidance=3.5))
    t0 = time.time()
    transformer = train_transformer(world, family, latents, y, embeds, transformer_steps, generator)
    record["transformer_time_s"] = round(time.time() - t0, 1)
    log(f"transformer: {transformer_steps} steps in {record['transformer_time_s']} s")
    record["heldout_rate_ode"] = correct_class_rate(family, transformer, vae, embeds, n=eval_samples)
    record["heldout_rate_sde"] = correct_class_rate(family, transformer, vae, embeds, n=eval_samples, eta=0.3)
    log(f"held-out correct-class rate of samples: ODE {record['heldout_rate_ode']:.3f}, "
        f"SDE (eta 0.3) {record['heldout_rate_sde']:.3f}")
    transformer.save_pretrained(os.path.join(out, "transformer"))
    vae.save_pretrained(os.path.join(out, "vae"))
    items = world.save_embeddings(os.path.join(out, "data"), embeds)
    with open(os.path.join(out, "data", "prompts.json"), "w") as f:
        json.dump(items, f, indent=1)
    with open(os.path.join(out, "BUILD.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


def main(argv=None):
    p = CommandParser(prog="python -m dancegrpo.digits.build", description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=family_names(), default="flux")
    p.add_argument("--world", choices=world_names(), default="digits",
                   help="digits: the default world; digits_large: the deeper, less linear one (docs/digits_large.md).")
    p.add_argument("--out", required=True, help="Folder to write transformer/, vae/, data/ and BUILD.json into.")
    p.add_argument("--vae_steps", type=int, default=300)
    p.add_argument("--transformer_steps", type=int, default=None, help="Default: the world's own (1500; Qwen-Image's digits_large 700).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_images", type=int, default=None,
                   help="Keep only the first N images of each split and N evaluation samples: a quick check of "
                        "the build, not a model to use.")
    args = p.parse_args(argv)
    try:
        return build(args.family, args.out, args.vae_steps, args.transformer_steps, args.seed,
                     log=lambda m: print(m, flush=True), max_images=args.max_images, world_name=args.world)
    except OSError as e:
        full = is_disk_full(e)
        say(f"{'stopped' if full else 'error'}: cannot write the build into {args.out!r}: {e.strerror}"
            f"{'' if full else f' ({e.filename})'}; nothing was written there (an earlier build in it is untouched)"
            f"{': free space and build again' if full else ''}")
        raise SystemExit(3 if full else 2) from None


if __name__ == "__main__":
    main()
