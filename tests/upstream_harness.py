"""The upstream stand-ins (tests/upstream_standin: a checkout of upstream's layout, `fastvideo/` a
namespace package without __init__.py, never installed nor on PYTHONPATH) as the tests drive them:
one train_one_step with the gradients read at every optimizer step, the rollout it drew, and an
independent float64 reference of JAGG built from the stand-in's own grpo_one_step."""
import copy
import functools
import importlib
import inspect
import os
import shutil
import sys

import pytest
import torch

from helpers import REPO_ROOT

STANDIN = os.path.join(REPO_ROOT, "tests", "upstream_standin")
# The stand-in trainers, by a key of their own; the family the adapter tells them apart as.
FILES = {"flux": "train_grpo_flux.py", "flux_lora": "train_grpo_flux_lora.py", "qwenimage": "train_grpo_qwenimage.py",
         "qwenimage_edit": "train_grpo_qwenimage_edit.py", "wan": "train_grpo_wan_2_1.py",
         "hunyuan": "train_grpo_hunyuan.py", "skyreels": "train_grpo_skyreels_i2v.py"}
FAMILY = {"flux": "flux", "flux_lora": "flux", "qwenimage": "qwenimage", "qwenimage_edit": "qwenimage_edit",
          "wan": "wan", "hunyuan": "hunyuan", "skyreels": "skyreels_i2v"}
VIDEO = ("hunyuan", "skyreels")
MODEL_CLASS = {"flux": "FluxTransformer2DModel", "qwenimage": "QwenImageTransformer2DModel",
               "qwenimage_edit": "QwenImageTransformer2DModel", "wan": "WanTransformer3DModel",
               "hunyuan": "HunyuanVideoTransformer3DModel", "skyreels_i2v": "HunyuanVideoTransformer3DModel"}
B, GA = 4, 2   # one prompt x 4 generations per step; two optimizer steps per step


def standin_file(key, root=STANDIN):
    return os.path.join(root, "fastvideo", FILES[key])


def standin_setup():
    """The stand-ins' fastvideo.utils.standin_setup, from the checkout a load_trainer put first."""
    return importlib.import_module("fastvideo.utils.standin_setup")


def copy_checkout(dest):
    """A copy of the stand-in checkout in a plain folder (not installed, not on any path)."""
    shutil.copytree(os.path.join(STANDIN, "fastvideo"), os.path.join(dest, "fastvideo"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    return str(dest)


def write_changed(tmp_path, key, old, new):
    """A copy of the stand-in checkout with one edit in one file, in a folder of its own (further edits
    go to the same copy)."""
    folder = tmp_path / "changed"
    path = standin_file(key, copy_checkout(folder) if not folder.exists() else str(folder))
    with open(path) as f:
        text = f.read()
    assert old in text
    with open(path, "w") as f:
        f.write(text.replace(old, new, 1))
    return path


def forget_fastvideo():
    for name in [n for n in sys.modules if n == "fastvideo" or n.startswith("fastvideo.")]:
        del sys.modules[name]


# Fixtures of every module that drives the stand-ins (imported there by name, which registers them).

@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """Upstream's step needs a process group (it all-gathers, all-reduces and waits at barriers): a
    one-rank gloo group for the module. The stand-in checkout is not put on sys.path by hand:
    load_trainer puts it there, as it does for a user's checkout."""
    from jagg_patch.upstream import load_trainer
    saved_path = list(sys.path)
    load_trainer(standin_file("flux"))
    standin_setup().init_single_process_group()
    yield
    import torch.distributed as dist
    dist.destroy_process_group()
    sys.path[:] = saved_path
    forget_fastvideo()


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # upstream appends to its reward file in the working folder


def _train_one_step_source(path):
    import ast
    text = open(path).read()
    (node,) = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "train_one_step"]
    return "".join(text.splitlines(keepends=True)[node.lineno - 1:node.end_lineno]), node


def standin_release(key, path=None):
    """The stand-in file's train_one_step as a known release (its token hashes, as on any Python): the
    restated step runs it as it runs a recorded upstream release."""
    from jagg_patch.seams import UpstreamRelease
    from jagg_patch.upstream.tokenhash import hash_tokens, source_tokens
    source, node = _train_one_step_source(path or standin_file(key))
    params = tuple(a.arg for a in node.args.args)
    files = tuple(dict.fromkeys(s for s in __import__("re").findall(r'"(\./[a-z_]*reward\.txt)"', source)))
    return [UpstreamRelease(hash_tokens(source_tokens(source, join_fstrings=join)), FAMILY[key],
                            f"{FILES[key]} (the stand-in)", params, files) for join in (True, False)]


@functools.lru_cache(maxsize=None)
def standin_releases():
    return tuple(r for key in FILES for r in standin_release(key))


@pytest.fixture(autouse=True)
def standins_known(monkeypatch):
    """The stand-ins are no release of upstream's (their token hashes differ from the recorded ones):
    for the tests of the restated step they are known, as a user's recorded release is. A test of an
    unknown source gives apply its own `releases`."""
    fingerprint_module = importlib.import_module("jagg_patch.upstream.fingerprint")
    monkeypatch.setattr(fingerprint_module, "UPSTREAM_RELEASES", fingerprint_module.UPSTREAM_RELEASES
                        + standin_releases())


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors]).clone()


def grad_of(params):
    """The flat gradient; a parameter the loss does not reach (Qwen-Image has some) counts as 0."""
    return flat(torch.zeros_like(p) if p.grad is None else p.grad for p in params)


from helpers import relative_error as rel  # noqa: E402,F401  (the one relative error, under the harness's name)


class Standin:
    """A stand-in trainer module (loaded with jagg_patch.upstream.load_trainer), its flags, one prompt
    batch, and a float64 transformer whose starting weights every `step` restores."""

    def __init__(self, key, cache_dir, tmp_path, *flags, path=None, group=True):
        from jagg_patch.upstream import load_trainer
        from helpers import missing_diffusers_class
        self.key, self.family = key, FAMILY[key]
        missing = missing_diffusers_class(MODEL_CLASS[self.family])
        if missing:
            pytest.skip(missing)
        self.module = load_trainer(path or standin_file(key))
        setup = standin_setup()
        if key in VIDEO:
            self._video(setup, tmp_path, group, flags)
            return
        self.args = setup.standin_parser().parse_args(
            ["--cache_dir", cache_dir, "--output_dir", str(tmp_path / "out"), "--num_generations", str(B),
             "--gradient_accumulation_steps", str(GA), "--clip_range", "0.05", "--max_grad_norm", "1e9",
             *(["--use_group"] if group else []), *map(str, flags)])
        if self.family == "wan":
            self.transformer = setup.load_wan_transformer(torch.float64)
            self.batch = next(setup.wan_prompts(1 if group else B, torch.float64))
        else:
            kind = "flux" if self.family == "flux" else "qwenimage"
            self.transformer, data_json = setup.load_transformer(kind, cache_dir, torch.float64)
            self.batch = next(setup.prompt_batches(kind, data_json, 1, torch.float64))
            if key == "flux_lora":
                setup.add_lora(self.transformer, 4).double()
            if self.family == "qwenimage_edit":
                self.batch = (*self.batch, *setup.condition_images(1, self.args.condition_h, self.args.condition_w,
                                                                   torch.float64))
        self.initial = copy.deepcopy(self.transformer.state_dict())

    def _video(self, setup, tmp_path, group, flags):
        """Upstream's video parser (no --clip_range / --adv_clip_max), VideoAlign on, 2 prompts per step
        without --use_group."""
        self.args = setup.video_parser(self.key).parse_args(
            ["--output_dir", str(tmp_path / "out"), "--num_generations", str(B), "--gradient_accumulation_steps",
             str(GA), "--max_grad_norm", "1e9", "--sampling_steps", "8", "--timestep_fraction", "0.6",
             "--use_videoalign", *(["--bestofn", str(B)] if self.key == "hunyuan" else []),
             *(["--use_group"] if group else []), *map(str, flags)])
        self.transformer = setup.load_video_transformer(self.key, torch.float64)
        self.loader_batch = next(setup.video_prompts(1 if group else B, torch.float64))
        self.empty = setup.empty_prompt(torch.float64)
        self.initial = copy.deepcopy(self.transformer.state_dict())
        self.lr = 1e-6   # AdamW's first step moves each weight by about lr: ratios stay within the clip 1e-4

    def trainable(self):
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def arguments(self, optimizer, scheduler):
        """train_one_step's arguments, positionally, as upstream's main passes them."""
        setup = standin_setup()
        if self.key == "hunyuan":
            return (self.args, torch.device("cpu"), self.transformer, None, setup.VideoAlign(), optimizer, scheduler,
                    iter([self.loader_batch]), self.args.max_grad_norm, 1)
        if self.key == "skyreels":
            return (self.args, torch.device("cpu"), self.transformer, setup.FirstFramePipe(), setup.FirstFrameVAE(),
                    setup.VideoAlign(), optimizer, scheduler, iter([self.loader_batch]), self.args.max_grad_norm, 1,
                    *self.empty)
        common = (self.args, torch.device("cpu"), self.transformer, None, setup.latent_reward, None, optimizer,
                  scheduler)
        tail = (None, self.args.max_grad_norm, None)
        ema = (None,) if "ema_handler" in inspect.signature(self.module.train_one_step).parameters else ()
        prompts = (iter([self.batch]),) if self.family == "flux" else self.batch
        return (*common, *prompts, *tail, *ema)

    def own_and_exact_steps(self):
        """(the file's own step, the adapter's exact mode restated, its stats): each as `step` returns it,
        from the same starting weights and seed."""
        from jagg_patch.upstream import apply, revert
        own = self.step()
        apply(self.module, mode="exact", restated=True)
        try:
            return own, self.step(), self.module.train_one_step.last_stats
        finally:
            revert(self.module)

    def step(self, seed=7):
        """(returns, gradients at each optimizer step, global RNG state afterwards, weights afterwards)."""
        torch.manual_seed(seed)
        self.transformer.load_state_dict(self.initial)
        self.transformer.zero_grad(set_to_none=True)
        trainable = self.trainable()
        optimizer = torch.optim.AdamW(trainable, lr=getattr(self, "lr", 1e-3))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        grads = []
        optimizer.register_step_pre_hook(lambda *_: grads.append(grad_of(trainable)))
        out = self.module.train_one_step(*self.arguments(optimizer, scheduler))
        return out, grads, torch.get_rng_state(), flat(p.detach() for p in trainable)


def recorded_rollout(module):
    """Wrap module.sample_reference_model: keep its result and the global RNG state right after it."""
    box = {}
    original = module.sample_reference_model

    @functools.wraps(original)
    def recording(*args, **kwargs):
        box["result"] = original(*args, **kwargs)
        box["rng"] = torch.get_rng_state()
        return box["result"]
    module.sample_reference_model = recording
    return box, original


def jagg_step_and_its_draw(standin, trained, **config):
    """One train_one_step of the stand-in under apply(**config), with one optimizer step (GA = B): (its
    gradient, its stats, the rollout's result, the transitions upstream drew right after the rollout:
    the first `trained` of each sample's randperm), the weights restored afterwards."""
    from jagg_patch.upstream import apply, revert
    box, original = recorded_rollout(standin.module)
    apply(standin.module, **config)
    try:
        _, (grad,), _, _ = standin.step()
        stats = standin.module.train_one_step.last_stats
    finally:
        revert(standin.module)
        standin.module.sample_reference_model = original
    torch.set_rng_state(box["rng"])
    steps = torch.stack([torch.randperm(standin.args.sampling_steps - 1) for _ in range(B)])[:, :trained]
    standin.transformer.load_state_dict(standin.initial)
    return grad, stats, box["result"], steps


# ---------------------------------------------------------------- an independent reference of JAGG

def sample_kwargs(standin, result, i):
    """grpo_one_step's conditioning arguments for sample i, as each stand-in's own train_one_step
    builds them (written here again, apart from jagg_patch.upstream.families)."""
    n, family, batch, args = B, standin.family, standin.batch, standin.args
    rep = (lambda t: t.repeat_interleave(n, dim=0)) if args.use_group else (lambda t: t)
    if family == "flux":
        return {"encoder_hidden_states": rep(batch[0])[i:i + 1], "pooled_prompt_embeds": rep(batch[1])[i:i + 1],
                "text_ids": rep(batch[2])[i:i + 1], "image_ids": result[4][i:i + 1]}
    if family == "wan":
        return {"encoder_hidden_states": rep(batch[0])[i:i + 1], "negative_prompt_embeds": rep(batch[1])[i:i + 1]}
    length = int(rep(batch[3])[i])
    values = {"encoder_hidden_states": rep(batch[0])[i:i + 1, :length],
              "prompt_attention_masks": rep(batch[1])[i:i + 1, :length], "txt_seq_lens": result[4][i],
              "img_shapes": [[(1, args.h // 16, args.w // 16)]]}
    if family == "qwenimage_edit":
        values["img_shapes"] = [[(1, args.h // 16, args.w // 16),
                                 (1, int(batch[4][0]) // 16, int(batch[5][0]) // 16)]]
        values["image_latents"] = result[5][i:i + 1]
    return values


class _Recording:
    """The transformer for grpo_one_step, keeping its raw output (train() / eval() pass through)."""

    def __init__(self, model, fixed=None):
        self.model, self.fixed, self.output = model, fixed, None

    def __call__(self, *args, **kwargs):
        if self.fixed is not None:
            return (self.fixed,)
        self.output = self.model(*args, **kwargs)[0]
        return (self.output,)

    def __getattr__(self, name):
        return getattr(self.model, name)


def reference_jagg_gradient(standin, result, steps, advantages, normaliser, alpha="timestep", exact_first=False):
    """sum over samples of J_0^T s_base + J_{W-1}^T s_corr for ONE group of all of each sample's
    trained transitions (steps [B, W], jagg_frac 1), float64 autograd, from the stand-in's own
    grpo_one_step: v_j its transformer output at member j, s_j the gradient of member j's PPO loss
    with respect to that output (through grpo_one_step on the fixed output), alpha by the model
    timesteps (the image trainers' int(sigma * 1000) / 1000 in float32, Wan's integers
    int(sigma * 1000) in float64) or by the member index. exact_first: a sample's first transition
    (k 0), where it is trained, backpropagated on its own and left out of the group (the deferred
    update's rule for rows identical to another sample's: samples that start from one latent)."""
    module, args, params = standin.module, standin.args, standin.trainable()
    _, all_latents, all_log_probs, sigmas = result[:4]
    total = [torch.zeros_like(p) for p in params]
    for i in range(all_latents.shape[0]):
        ks = sorted(int(k) for k in steps[i])
        first = [k for k in ks if exact_first and k == 0]
        ks = [k for k in ks if k not in first]
        # the model's timestep as the family's model gets it: Flux's int(sigma * 1000) / 1000 in float32,
        # Wan's the integers themselves (in float64 here: its alpha's ratios exact)
        integers = [int(sigmas[k] * 1000) for k in ks]
        t = (torch.tensor(integers, dtype=torch.float64) if standin.family == "wan"
             else (torch.tensor(integers) / 1000).double())
        index = torch.arange(len(ks), dtype=torch.float64) / (len(ks) - 1)
        alphas = (t[0] - t) / (t[0] - t[-1]) if alpha == "timestep" else index

        def call(k, model):
            return module.grpo_one_step(args=args, latents=all_latents[i:i + 1, k],
                                        pre_latents=all_latents[i:i + 1, k + 1], transformer=model,
                                        timesteps=torch.tensor([int(sigmas[k] * 1000)]), i=torch.tensor(k),
                                        sigma_schedule=sigmas, **sample_kwargs(standin, result, i))

        def loss_at(k, v):
            log_prob = call(k, _Recording(standin.transformer, v))
            adv = advantages[i:i + 1].clamp(-args.adv_clip_max, args.adv_clip_max)
            ratio = torch.exp(log_prob - all_log_probs[i:i + 1, k])
            clipped = torch.clamp(ratio, 1 - args.clip_range, 1 + args.clip_range)
            return torch.mean(torch.maximum(-adv * ratio, -adv * clipped)) / normaliser

        for k in first + (ks if len(ks) == 1 else []):
            recording = _Recording(standin.transformer)
            call(k, recording)
            grads = torch.autograd.grad(loss_at(k, recording.output), params, allow_unused=True)
            total = [acc + (0 if g is None else g) for acc, g in zip(total, grads)]
        if len(ks) < 2:
            continue
        outputs = []
        for k in ks:
            recording = _Recording(standin.transformer)
            call(k, recording)
            outputs.append(recording.output)
        upstream = []
        for k, v in zip(ks, outputs):
            proxy = v.detach().requires_grad_(True)
            (s,) = torch.autograd.grad(loss_at(k, proxy), proxy)
            upstream.append(s)
        s_base = sum((1 - a) * s for a, s in zip(alphas.tolist(), upstream))
        s_corr = sum(a * s for a, s in zip(alphas.tolist(), upstream))
        grads = torch.autograd.grad([outputs[0], outputs[-1]], params, [s_base, s_corr], allow_unused=True)
        total = [acc + (0 if g is None else g) for acc, g in zip(total, grads)]
    return flat(total)


# ---------------------------------------------------------------- the video trainers' reference

def video_rollout(standin, result):
    """(rewards by name, all_latents, all_log_probs, sigma_schedule) of a video stand-in's rollout result."""
    if standin.key == "hunyuan":
        _, _, vq, mq, all_latents, all_log_probs, sigmas = result
        return {"vq": vq.float(), "mq": mq.float()}, all_latents, all_log_probs, sigmas
    _, _, rewards, all_latents, all_log_probs, sigmas, _ = result
    return {"reward": rewards.float()}, all_latents, all_log_probs, sigmas


def video_advantages(standin, rewards):
    """Each reward's advantages as the stand-in's step computes them (written here again): HunyuanVideo per
    block of num_generations always; SkyReels per group, or by the rewards' own statistics without groups."""
    g = standin.args.num_generations

    def per_block(r):
        out = torch.zeros_like(r)
        for s in range(0, len(r) // g * g, g):
            out[s:s + g] = (r[s:s + g] - r[s:s + g].mean()) / (r[s:s + g].std() + 1e-8)
        return out
    if standin.key == "hunyuan" or standin.args.use_group:
        return {name: per_block(r) for name, r in rewards.items()}
    return {name: (r - r.mean()) / (r.std() + 1e-8) for name, r in rewards.items()}


def video_selection_and_draw(standin, advantages, rng_after_rollout, trained):
    """(the trained samples' rollout rows, each one's first `trained` transitions of its randperm), drawn
    as the stand-in's step draws them right after its rollout: HunyuanVideo's best-of-n shuffle first."""
    args, rows = standin.args, torch.arange(len(next(iter(advantages.values()))))
    torch.set_rng_state(rng_after_rollout)
    if standin.key == "hunyuan":
        order = torch.argsort(args.vq_coef * advantages["vq"] + args.mq_coef * advantages["mq"])
        picked = torch.cat([order[len(order) - (args.bestofn + 1) // 2:], order[:args.bestofn // 2]])
        picked = picked[torch.randperm(len(picked))]
        rows = rows if args.num_generations == args.bestofn else picked
    steps = torch.stack([torch.randperm(args.sampling_steps - 1) for _ in range(len(rows))])[:, :trained]
    return rows, steps


def video_kwargs(standin, result, row):
    """grpo_one_step's conditioning arguments for rollout row `row` (batch 1), as the stand-ins build them."""
    rep = (lambda t: t.repeat_interleave(standin.args.num_generations, dim=0)) if standin.args.use_group else (
        lambda t: t)
    prompt, mask, _ = standin.loader_batch
    values = {"encoder_hidden_states": rep(prompt)[row:row + 1], "encoder_attention_mask": rep(mask)[row:row + 1]}
    if standin.key == "skyreels":
        values.update(empty_cond_hidden_states=standin.empty[0][None], empty_cond_attention_mask=standin.empty[1][None],
                      first_frame_latents=result[6])
    return values


def reference_video_gradient(standin, result, rows, steps, advantages, window, jagg_frac, alpha="timestep",
                             adv_clip_max=5.0):
    """The JAGG gradient of one step of a video stand-in, float64 autograd of its own grpo_one_step:
    per trained sample, its trained transitions in denoising order cut into groups of `window`, the first
    round_half_up(groups * jagg_frac) (of 2 or more) as J_0^T s_base + J_{W-1}^T s_corr with alpha from
    the integer model timesteps or the member index, the others each member's own backward; the loss
    with the trainers' constants (clip 1e-4, advantage clamp 5.0, or `adv_clip_max` for a file edited
    there), HunyuanVideo's vq_coef * L_vq + mq_coef * L_mq; normalised by GA * trained transitions."""
    module, args, params = standin.module, standin.args, standin.trainable()
    _, all_latents, all_log_probs, sigmas = video_rollout(standin, result)
    coefs = {"vq": args.vq_coef, "mq": args.mq_coef} if standin.key == "hunyuan" else {"reward": 1.0}
    normaliser = args.gradient_accumulation_steps * steps.shape[1]
    total = [torch.zeros_like(p) for p in params]

    def add(grads):
        for acc, g in zip(total, grads):
            if g is not None:
                acc += g
    for row, trained in zip(rows.tolist(), steps):
        ks = sorted(int(k) for k in trained)

        def call(k, model):
            return module.grpo_one_step(args=args, latents=all_latents[row:row + 1, k],
                                        pre_latents=all_latents[row:row + 1, k + 1], transformer=model,
                                        timesteps=torch.tensor([int(sigmas[k] * 1000)]), i=torch.tensor(k),
                                        sigma_schedule=sigmas, **video_kwargs(standin, result, row))

        def loss_at(k, v):
            ratio = torch.exp(call(k, _Recording(standin.transformer, v)) - all_log_probs[row:row + 1, k])
            loss = 0
            for name, coef in coefs.items():
                adv = advantages[name][row:row + 1].clamp(-adv_clip_max, adv_clip_max)
                term = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - 1e-4, 1 + 1e-4))
                loss = loss + coef * (torch.mean(term) / normaliser)
            return loss

        chunks = [ks[i:i + window] for i in range(0, len(ks), window)]
        n_jagg = int(len(chunks) * jagg_frac + 0.5)
        for g, members in enumerate(chunks):
            outputs = []
            for k in members:
                recording = _Recording(standin.transformer)
                call(k, recording)
                outputs.append(recording.output)
            if g >= n_jagg or len(members) < 2:
                add(torch.autograd.grad(sum(loss_at(k, v) for k, v in zip(members, outputs)), params,
                                        allow_unused=True))
                continue
            t = torch.tensor([float(int(sigmas[k] * 1000)) for k in members], dtype=torch.float64)
            index = torch.arange(len(members), dtype=torch.float64) / (len(members) - 1)
            alphas = ((t[0] - t) / (t[0] - t[-1]) if alpha == "timestep" else index).tolist()
            upstream = []
            for k, v in zip(members, outputs):
                proxy = v.detach().requires_grad_(True)
                upstream.append(torch.autograd.grad(loss_at(k, proxy), proxy)[0])
            s_base = sum((1 - a) * s for a, s in zip(alphas, upstream))
            s_corr = sum(a * s for a, s in zip(alphas, upstream))
            add(torch.autograd.grad([outputs[0], outputs[-1]], params, [s_base, s_corr], allow_unused=True))
    return flat(total)


def video_jagg_step(standin, **config):
    """One train_one_step of a video stand-in under apply(**config): (its gradient at each optimizer step,
    its stats, the rollout's result, the global RNG state right after the rollout, its returns), the
    weights restored afterwards."""
    from jagg_patch.upstream import apply, revert
    box, original = recorded_rollout(standin.module)
    apply(standin.module, **config)
    try:
        out, grads, _, _ = standin.step()
        stats = standin.module.train_one_step.last_stats
    finally:
        revert(standin.module)
        standin.module.sample_reference_model = original
    standin.transformer.load_state_dict(standin.initial)
    return grads, stats, box["result"], box["rng"], out
