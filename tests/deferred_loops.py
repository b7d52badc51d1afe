"""GRPO update loops written the way their codebases write them (GRPO_LOOPS.md): the model called once
per trained step in grad mode, the log-prob an analytic Gaussian of the stored next latent,
loss.backward() at once, the clip and the optimizer step after an accumulation. Tiny float64 models.

Each loop labels the rows of its update calls with the truth (sample, half, step), which the deferred
proxy has to find out itself; `reference_gradients` computes the JAGG gradient from those labels with
plain autograd (the signals recorded by a wrapper written here, the groups and weights written out),
reusing nothing of jagg_patch.
"""
import contextlib
import math
from dataclasses import dataclass, field

import torch

DT = torch.float64


@dataclass
class VelocityOutput:
    sample: torch.Tensor


class Velocity(torch.nn.Module):
    """A small nonlinear velocity model called as the diffusers models are (hidden_states, timestep,
    encoder_hidden_states, return_dict); `adapter` is a LoRA-like delta that disable_adapter() turns off."""

    def __init__(self, channels=4, text=3, hidden=8, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w_in = torch.nn.Parameter(torch.randn(channels, hidden, generator=g, dtype=DT) * 0.6)
        self.w_text = torch.nn.Parameter(torch.randn(text, hidden, generator=g, dtype=DT) * 0.6)
        self.w_t = torch.nn.Parameter(torch.randn(hidden, generator=g, dtype=DT))
        self.w_out = torch.nn.Parameter(torch.randn(hidden, channels, generator=g, dtype=DT) * 0.5)
        self.adapter = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g, dtype=DT) * 0.1)
        self._adapter_on = True

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=True):
        b = hidden_states.shape[0]
        t = torch.as_tensor(timestep, dtype=hidden_states.dtype).reshape(-1).expand(b)
        text = encoder_hidden_states.mean(dim=1) @ self.w_text
        h = torch.tanh(hidden_states @ self.w_in + text[:, None, :] + t[:, None, None] * self.w_t)
        if self._adapter_on:
            h = h + torch.tanh(h @ self.adapter)
        v = h @ self.w_out
        return VelocityOutput(sample=v) if return_dict else (v,)

    @contextlib.contextmanager
    def disable_adapter(self):
        self._adapter_on = False
        try:
            yield
        finally:
            self._adapter_on = True


@dataclass
class Setting:
    prompts: int = 2
    generations: int = 3
    steps: int = 7            # S sampling steps, S - 1 trainable transitions
    trained: int = 4          # transitions a sample trains
    tokens: int = 5
    channels: int = 4
    text_tokens: int = 2
    eta: float = 0.7
    clip_range: float = 0.2
    adv_clip_max: float = 5.0
    accumulation: int = 6     # samples per optimizer step (GA)
    batch: int = 2            # samples per update call (SD / Flow-GRPO loops)
    guidance: float = 3.0
    cfg: bool = True
    kl_beta: float = 0.0
    seed: int = 0
    shared_noise: bool = False   # one initial latent for every sample (DanceGRPO SD)
    reevaluate: bool = False     # the Flux loop recomputes every rollout row's output without grad first
    timesteps: str = "tensor"    # the Flux loop's timestep argument: "tensor" ([1] float64), "float" (a Python
    #                              float), "mixed" (a float in the rollout, a 0-d float64 tensor in the update)

    @property
    def samples(self):
        return self.prompts * self.generations

    def sigmas(self):
        return torch.linspace(1.0, 0.0, self.steps + 1, dtype=DT) * 0.9 + 0.05

    def embeddings(self):
        g = torch.Generator().manual_seed(100 + self.seed)
        prompts = torch.randn(self.prompts, self.text_tokens, 3, generator=g, dtype=DT)
        negative = torch.randn(1, self.text_tokens, 3, generator=g, dtype=DT)
        return prompts.repeat_interleave(self.generations, dim=0), negative


def gaussian_step(x, v, sigma, sigma_next, eta, prev=None, generator=None):
    """(next latent, log-prob per sample): an SDE step with mean x + (sigma' - sigma) v and std eta sqrt(sigma - sigma')."""
    mean = x + (sigma_next - sigma) * v
    std = eta * math.sqrt(sigma - sigma_next)
    if prev is None:
        prev = mean + std * torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
    log_prob = -((prev.detach() - mean) ** 2) / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return prev, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def ppo(log_prob, old, advantage, s):
    a = advantage.clamp(-s.adv_clip_max, s.adv_clip_max)
    ratio = torch.exp(log_prob - old)
    return torch.maximum(-a * ratio, -a * ratio.clamp(1 - s.clip_range, 1 + s.clip_range))


def advantages_of(x0, s):
    rewards = -((x0 - 0.2) ** 2).mean(dim=(1, 2))
    groups = rewards.reshape(s.prompts, s.generations)
    adv = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-8)
    return adv.reshape(-1)


@dataclass
class Log:
    """What a loop tells the test: per update call, (sample, half, step) of each row; the gradient at
    each optimizer step."""
    calls: list = field(default_factory=list)
    grads: list = field(default_factory=list)


def _optimizer_step(model, optimizer, log, clip):
    if clip == "torch":
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1e9)
    optimizer.step()
    optimizer.zero_grad()


def capture_grads(optimizer, params, log):
    """Record the gradient at each optimizer step (a pre-hook registered after the proxy's)."""
    return optimizer.register_step_pre_hook(
        lambda *a: log.grads.append(torch.cat([p.grad.reshape(-1).clone() if p.grad is not None
                                               else torch.zeros(p.numel(), dtype=p.dtype) for p in params])))


# ---------------------------------------------------------------- DanceGRPO's Flux trainer, per sample

def timestep_of(sigma, form, update):
    """The timestep argument in the form a loop passes it (Setting.timesteps)."""
    if form == "float" or (form == "mixed" and not update):
        return float(sigma)
    return sigma.reshape(()) if form == "mixed" else sigma.expand(1)


def flux_loop(model, optimizer, s, log, generator, clip="torch"):
    """upstream's train_one_step: one sample per call, keyword calls with return_dict=False, each
    sample's trained steps a random permutation's first, an optimizer step every `accumulation` samples."""
    sigmas, (cond, _) = s.sigmas(), s.embeddings()
    model.eval()
    latents, log_probs = [], []
    for i in range(s.samples):
        z = torch.randn(1, s.tokens, s.channels, generator=generator, dtype=DT)
        traj, lp = [z], []
        with torch.no_grad():
            for k in range(s.steps):
                v = model(hidden_states=z, timestep=timestep_of(sigmas[k], s.timesteps, False),
                          encoder_hidden_states=cond[i:i + 1], return_dict=False)[0]
                z, logp = gaussian_step(z, v, float(sigmas[k]), float(sigmas[k + 1]), s.eta, generator=generator)
                traj.append(z)
                lp.append(logp)
        latents.append(torch.cat(traj))
        log_probs.append(torch.cat(lp))
    latents, log_probs = torch.stack(latents), torch.stack(log_probs) - 0.05 * torch.randn(
        s.samples, s.steps, generator=generator, dtype=DT)
    if s.reevaluate:   # e.g. old log-probs recomputed: the rollout's rows again, under no_grad, before the update
        with torch.no_grad():
            for k in range(s.steps):
                model(hidden_states=latents[:, k], timestep=sigmas[k].expand(s.samples), encoder_hidden_states=cond,
                      return_dict=False)
    adv = advantages_of(latents[:, -1], s)
    perms = torch.stack([torch.randperm(s.steps - 1, generator=generator) for _ in range(s.samples)])
    model.train()
    for i in range(s.samples):
        for j in range(s.trained):
            k = int(perms[i, j])
            log.calls.append([(i, 0, k)])
            v = model(hidden_states=latents[i, k:k + 1], timestep=timestep_of(sigmas[k], s.timesteps, True),
                      encoder_hidden_states=cond[i:i + 1], return_dict=False)[0]
            _, logp = gaussian_step(latents[i, k:k + 1], v, float(sigmas[k]), float(sigmas[k + 1]), s.eta,
                                    prev=latents[i, k + 1:k + 2])
            loss = ppo(logp, log_probs[i, k], adv[i], s).mean() / (s.accumulation * s.trained)
            loss.backward()
        if (i + 1) % s.accumulation == 0:
            _optimizer_step(model, optimizer, log, clip)


# ---------------------------------------------------------------- DanceGRPO's SD trainer, batched, CFG

def guided(out, g, rows):
    uncond, cond = out[:rows], out[rows:]
    return uncond + g * (cond - uncond)


def batched_rollout(model, s, generator, initial, velocity):
    """Every sample's trajectory in batches of s.batch, under no_grad: initial(rows) the first latents
    (in the dtype the model gets them, which every step keeps), velocity(z, k, start, rows) the model's
    (guided) output; the step in float64. Returns (latents [N, S+1, ...], log-probs [N, S])."""
    sigmas = s.sigmas()
    model.eval()
    latents, log_probs = [], []
    for start in range(0, s.samples, s.batch):
        rows = min(s.batch, s.samples - start)
        z = initial(rows)
        traj, lp = [z], []
        with torch.no_grad():
            for k in range(s.steps):
                v = velocity(z, k, start, rows).to(DT)
                step, logp = gaussian_step(z.to(DT), v, float(sigmas[k]), float(sigmas[k + 1]), s.eta,
                                           generator=generator)
                z = step.to(z.dtype)
                traj.append(z)
                lp.append(logp)
        latents.append(torch.stack(traj, dim=1))
        log_probs.append(torch.stack(lp, dim=1))
    return torch.cat(latents), torch.cat(log_probs)


def sd_loop(model, optimizer, s, log, generator, clip="torch"):
    """train_grpo_sd.py's shape: batches of `batch` samples, [uncond; cond] doubled calls with both halves
    kept in the loss, positional update calls reading .sample with a [B] timestep, rollout calls by keyword
    with a 0-d timestep, each sample's steps permuted, the loss a mean over the batch."""
    sigmas, (cond, negative) = s.sigmas(), s.embeddings()
    shared = torch.randn(1, s.tokens, s.channels, generator=generator, dtype=DT)

    def initial(rows):
        return shared.expand(rows, -1, -1).clone() if s.shared_noise else torch.randn(
            rows, s.tokens, s.channels, generator=generator, dtype=DT)

    def velocity(z, k, start, rows):
        embeds = torch.cat([negative.expand(rows, -1, -1), cond[start:start + rows]]) if s.cfg \
            else cond[start:start + rows]
        out = model(hidden_states=torch.cat([z, z]) if s.cfg else z, timestep=sigmas[k], encoder_hidden_states=embeds,
                    return_dict=False)[0]
        return guided(out, s.guidance, rows) if s.cfg else out

    latents, log_probs = batched_rollout(model, s, generator, initial, velocity)
    adv = advantages_of(latents[:, -1], s)
    perms = torch.stack([torch.randperm(s.steps - 1, generator=generator) for _ in range(s.samples)])
    model.train()
    calls_per_step = math.ceil(s.accumulation / s.batch) * s.trained
    done = 0
    for start in range(0, s.samples, s.batch):
        idx = list(range(start, min(start + s.batch, s.samples)))
        rows = len(idx)
        embeds = torch.cat([negative.expand(rows, -1, -1), cond[idx]]) if s.cfg else cond[idx]
        for j in range(s.trained):
            ks = [int(perms[i, j]) for i in idx]
            x = torch.stack([latents[i, k] for i, k in zip(idx, ks)])
            t = torch.stack([sigmas[k] for k in ks])
            halves = (1, 0) if s.cfg else (0,)
            log.calls.append([(i, h, k) for h in sorted(halves) for i, k in zip(idx, ks)])
            out = model(torch.cat([x, x]) if s.cfg else x, torch.cat([t, t]) if s.cfg else t, embeds).sample
            v = guided(out, s.guidance, rows) if s.cfg else out
            nxt = torch.stack([latents[i, k + 1] for i, k in zip(idx, ks)])
            logp = torch.stack([gaussian_step(x[r:r + 1], v[r:r + 1], float(sigmas[k]), float(sigmas[k + 1]), s.eta,
                                              prev=nxt[r:r + 1])[1][0] for r, k in enumerate(ks)])
            old = torch.stack([log_probs[i, k] for i, k in zip(idx, ks)])
            loss = ppo(logp, old - 0.05, adv[idx], s).mean() / calls_per_step
            loss.backward()
            done += 1
            if done % calls_per_step == 0:
                _optimizer_step(model, optimizer, log, clip)


# ---------------------------------------------------------------- Flow-GRPO's SD3 trainer

def flowgrpo_loop(model, optimizer, s, log, generator, clip="torch"):
    """scripts/train_sd3.py's shape: every sample its own noise, doubled keyword calls, the FIRST `trained`
    steps in order, the uncond half detached, a KL term against disable_adapter() under no_grad."""
    sigmas, (cond, negative) = s.sigmas(), s.embeddings()

    def velocity(z, k, start, rows):
        embeds = torch.cat([negative.expand(rows, -1, -1), cond[start:start + rows]])
        out = model(hidden_states=torch.cat([z, z]), timestep=sigmas[k].expand(2 * rows), encoder_hidden_states=embeds,
                    return_dict=False)[0]
        return guided(out, s.guidance, rows)

    latents, log_probs = batched_rollout(
        model, s, generator, lambda rows: torch.randn(rows, s.tokens, s.channels, generator=generator, dtype=DT),
        velocity)
    adv = advantages_of(latents[:, -1], s)
    order = torch.randperm(s.samples, generator=generator).tolist()
    model.train()
    calls_per_step = math.ceil(s.accumulation / s.batch) * s.trained
    done = 0
    for start in range(0, s.samples, s.batch):
        idx = order[start:start + s.batch]
        rows = len(idx)
        embeds = torch.cat([negative.expand(rows, -1, -1), cond[idx]])
        for k in range(s.trained):
            x, t = latents[idx, k], sigmas[k].expand(2 * rows)
            log.calls.append([(i, h, k) for h in (0, 1) for i in idx])

            def log_prob_of(net):
                out = net(hidden_states=torch.cat([x, x]), timestep=t, encoder_hidden_states=embeds,
                          return_dict=False)[0]
                uncond, cond_out = out[:rows].detach(), out[rows:]
                v = uncond + s.guidance * (cond_out - uncond)
                mean = x + (float(sigmas[k + 1]) - float(sigmas[k])) * v
                return gaussian_step(x, v, float(sigmas[k]), float(sigmas[k + 1]), s.eta,
                                     prev=latents[idx, k + 1])[1], mean

            logp, mean = log_prob_of(model)
            loss = ppo(logp, log_probs[idx, k] - 0.05, adv[idx], s).mean()
            if s.kl_beta > 0:
                with torch.no_grad(), model.disable_adapter():
                    _, mean_ref = log_prob_of(model)
                std = s.eta * math.sqrt(float(sigmas[k]) - float(sigmas[k + 1]))
                loss = loss + s.kl_beta * ((mean - mean_ref) ** 2).mean() / (2 * std ** 2)
            (loss / calls_per_step).backward()
            done += 1
            if done % calls_per_step == 0:
                _optimizer_step(model, optimizer, log, clip)


LOOPS = {"flux": flux_loop, "sd": sd_loop, "flowgrpo": flowgrpo_loop}


# ---------------------------------------------------------------- the independent reference

class SignalRecorder:
    """Stands where the loop calls its model (written here, independently of the proxy): a call in
    grad mode returns a leaf of the model's output, whose .grad collects the loop's signal."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        if not torch.is_grad_enabled():
            return out
        tensor = out.sample if hasattr(out, "sample") else out[0]
        leaf = tensor.detach().requires_grad_(True)
        self.calls.append((args, kwargs, leaf))
        return VelocityOutput(sample=leaf) if hasattr(out, "sample") else (leaf,)

    def __getattr__(self, name):
        return getattr(self.model, name)


def alpha_of(t, rule):
    w = len(t)
    if rule == "index":
        return [j / (w - 1) for j in range(w)]
    return [(t[0] - tj) / (t[0] - t[-1]) for tj in t]


def reference_gradients(model, loop, s, config, seed, identical=lambda label: False):
    """The JAGG gradient at each optimizer step of `loop` (jagg_reference), from the labels the loop
    gives its rows."""
    recorder, log = SignalRecorder(model), Log()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    steps = []
    optimizer.register_step_pre_hook(lambda *a: steps.append(len(recorder.calls)))
    LOOPS[loop](recorder, optimizer, s, log, torch.Generator().manual_seed(seed), clip="none")
    return jagg_reference(model, recorder.calls, log.calls, steps, config, identical, velocity_row)


def jagg_reference(model, calls, labels, steps, config, identical, row_args):
    """The JAGG gradient at each optimizer step: calls [(args, kwargs, leaf)] as SignalRecorder keeps
    them, labels [[(sample, half, step) of each row] per call], steps the call counts at the optimizer
    steps, row_args(args, kwargs, r) the arguments of a call on row r alone. Each (sample, half)'s
    trained rows in step order cut into groups of W, the first round_half_up(n * jagg_frac) folded onto
    their endpoints (mode endpoints: each endpoint its own signal, weighted W/2), every other row (and
    every row `identical(label)` says cannot be told from another) backpropagated with its own signal."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads, first = [], 0
    for last in steps:
        rows = {}
        for (args, kwargs, leaf), call_labels in zip(calls[first:last], labels[first:last]):
            for r, label in enumerate(call_labels):
                rows.setdefault(label[:2], []).append((label, row_args(args, kwargs, r), leaf, r))
        surrogate = 0.0
        for members in rows.values():
            plain = [m for m in members if not identical(m[0])]
            surrogate = surrogate + sum(_row_term(model, m, m[2].grad[m[3]]) for m in members if identical(m[0]))
            plain.sort(key=lambda m: m[0][2])
            n_groups = math.ceil(len(plain) / config.window)
            n_jagg = math.floor(n_groups * config.jagg_frac + 0.5)
            for g in range(n_groups):
                group = plain[g * config.window:(g + 1) * config.window]
                signals = [m[2].grad[m[3]] for m in group]
                if config.mode == "exact" or g >= n_jagg or len(group) < 2:
                    surrogate = surrogate + sum(_row_term(model, m, sig) for m, sig in zip(group, signals))
                    continue
                if config.mode == "endpoints":
                    half = len(group) / 2
                    surrogate = surrogate + half * (_row_term(model, group[0], signals[0])
                                                    + _row_term(model, group[-1], signals[-1]))
                    continue
                t = [float(torch.as_tensor(m[1]["timestep"], dtype=DT).reshape(-1)[0]) for m in group]
                alpha = alpha_of(t, config.alpha)
                base = sum((1 - a) * sig for a, sig in zip(alpha, signals))
                corr = sum(a * sig for a, sig in zip(alpha, signals))
                surrogate = surrogate + _row_term(model, group[0], base) + _row_term(model, group[-1], corr)
        g = torch.autograd.grad(surrogate, params, allow_unused=True)
        grads.append(torch.cat([x.reshape(-1) if x is not None else torch.zeros(p.numel(), dtype=p.dtype)
                                for x, p in zip(g, params)]))
        first = last
    return grads


def velocity_row(args, kwargs, r):
    """Velocity's arguments for row r of a call, by name (a 0-d timestep for every row)."""
    bound = dict(zip(("hidden_states", "timestep", "encoder_hidden_states"), args), **kwargs)
    t = torch.as_tensor(bound["timestep"], dtype=DT).reshape(-1)   # a Python float's own float64 value
    return {"hidden_states": bound["hidden_states"][r:r + 1], "timestep": t[r if t.numel() > 1 else 0].reshape(1),
            "encoder_hidden_states": bound["encoder_hidden_states"][r:r + 1]}


def _row_term(model, m, signal):
    out = model(**m[1], return_dict=False)[0]
    return (out[0] * signal).sum()


# ---------------------------------------------------------------- a real diffusers model: Flux

def tiny_flux(dtype=DT, seed=0, guidance=True):
    """A tiny diffusers FluxTransformer2DModel (ENVIRONMENT.md's tiny config)."""
    from diffusers import FluxTransformer2DModel
    default = torch.get_default_dtype()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)   # built in its dtype: a cast afterwards makes diffusers warn
        try:
            return FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                          pooled_projection_dim=32, axes_dims_rope=(4, 4, 8), guidance_embeds=guidance)
        finally:
            torch.set_default_dtype(default)


def flux_model_loop(model, optimizer, s, log, generator, autocast=None, kl=False):
    """DanceGRPO's Flux update on a real FluxTransformer2DModel, `batch` samples per call (each at its
    own step): img_ids [L, 3] and txt_ids [T, 3] shared by every row (T = s.text_tokens, which the test
    sets equal to the batch), guidance per row; kl: a reference call with the adapters disabled under
    no_grad after each update call (peft through diffusers' disable_adapters / enable_adapters)."""
    sigmas, tokens = s.sigmas(), 16
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(200 + s.seed)
    text = torch.randn(s.prompts, s.text_tokens, 32, generator=g, dtype=DT).to(dtype).repeat_interleave(
        s.generations, dim=0)
    pooled = torch.randn(s.prompts, 32, generator=g, dtype=DT).to(dtype).repeat_interleave(s.generations, dim=0)
    txt_ids = torch.randint(0, 4, (s.text_tokens, 3), generator=g).to(dtype)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"),
                          dim=-1).reshape(-1, 3).to(dtype)
    context = autocast or contextlib.nullcontext

    def call(net, x, t, rows):
        with context():
            return net(hidden_states=x, encoder_hidden_states=text[rows], pooled_projections=pooled[rows],
                       timestep=t, img_ids=img_ids, txt_ids=txt_ids, guidance=torch.full((len(rows),), 3.5, dtype=dtype),
                       return_dict=False)[0]

    latents, log_probs = batched_rollout(
        model, s, generator, lambda rows: torch.randn(rows, tokens, 64, generator=generator, dtype=DT).to(dtype),
        lambda z, k, start, rows: call(model, z, sigmas[k].expand(rows).to(dtype), list(range(start, start + rows))))
    adv = advantages_of(latents[:, -1].to(DT), s)
    perms = torch.stack([torch.randperm(s.steps - 1, generator=generator) for _ in range(s.samples)])
    model.train()
    calls_per_step = math.ceil(s.accumulation / s.batch) * s.trained
    done = 0
    for start in range(0, s.samples, s.batch):
        rows = list(range(start, min(start + s.batch, s.samples)))
        for j in range(s.trained):
            ks = [int(perms[i, j]) for i in rows]
            log.calls.append([(i, 0, k) for i, k in zip(rows, ks)])
            x = torch.stack([latents[i, k] for i, k in zip(rows, ks)])
            t = torch.stack([sigmas[k] for k in ks]).to(dtype)
            v = call(model, x, t, rows).to(DT)
            nxt = torch.stack([latents[i, k + 1] for i, k in zip(rows, ks)]).to(DT)
            logp = torch.stack([gaussian_step(x[r:r + 1].to(DT), v[r:r + 1], float(sigmas[k]), float(sigmas[k + 1]),
                                              s.eta, prev=nxt[r:r + 1])[1][0] for r, k in enumerate(ks)])
            loss = ppo(logp, torch.stack([log_probs[i, k] for i, k in zip(rows, ks)]) - 0.05, adv[rows], s).mean()
            if kl:
                with torch.no_grad():
                    model.disable_adapters()
                    v_ref = call(model, x, t, rows).to(DT)
                    model.enable_adapters()
                loss = loss + 0.5 * ((v - v_ref) ** 2).mean()
            (loss / calls_per_step).backward()
            done += 1
            if done % calls_per_step == 0:
                _optimizer_step(model, optimizer, log, "torch")

