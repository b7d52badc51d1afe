"""Flow-GRPO-Fast on the shared core: the step kernels against float64 densities
written out here, the windowed sampler, Flow-GRPO's advantages, the KL term, JAGG over the window."""
import math

import pytest
import torch

from dancegrpo.algo import advantages, grpo
from dancegrpo import trainer
from dancegrpo.algo.sde import sigma_schedule
from dancegrpo.algo.kernels import SDE_TYPES, ode_transition, sde_transition
from dancegrpo.algo.rollout import predict_velocity

from helpers import FAST, read_metrics, run_main

SIGMAS = sigma_schedule(6, 3.0).double()


def states(seed=0, b=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 4, 8, generator=g, dtype=torch.float64)
    v = torch.randn(b, 4, 8, generator=g, dtype=torch.float64)
    nxt = torch.randn(b, 4, 8, generator=g, dtype=torch.float64)
    return x, v, nxt


def flow_grpo_reference(v, x, nxt, a, k):
    """Flow-GRPO's sde kernel, written out with Python floats and torch.distributions."""
    s, s1 = float(SIGMAS[k]), float(SIGMAS[k + 1])
    s_for_g = float(SIGMAS[1]) if s == 1.0 else s
    g = a * math.sqrt(s / (1 - s_for_g))
    dt = s1 - s
    mu = x * (1 + g * g * dt / (2 * s)) + v * (1 + g * g * (1 - s) / (2 * s)) * dt
    return torch.distributions.Normal(mu, g * math.sqrt(-dt)).log_prob(nxt).mean(dim=(1, 2))


def cps_reference(v, x, nxt, a, k):
    """The coefficient-preserving kernel from its definition: x0 and x1 predictions mixed so that
    the noise coefficients' squares sum to sigma'^2; log-prob unscaled."""
    s, s1 = float(SIGMAS[k]), float(SIGMAS[k + 1])
    noise = s1 * math.sin(a * math.pi / 2)
    x0, x1 = x - s * v, x + (1 - s) * v
    mu = (1 - s1) * x0 + s1 * math.cos(a * math.pi / 2) * x1
    assert abs(math.sqrt(s1 ** 2 - noise ** 2) - s1 * math.cos(a * math.pi / 2)) < 1e-12
    return -((nxt - mu) ** 2).mean(dim=(1, 2))


@pytest.mark.parametrize("k", [0, 2, 4])   # k 0: sigma == 1, Flow-GRPO's sigma_max case
def test_flow_grpo_kernel_against_float64_density(k):
    x, v, nxt = states(k)
    assert (float(SIGMAS[k]) == 1.0) == (k == 0)
    _, logp = sde_transition("flow_grpo", v, x, 0.7, SIGMAS, k, prev_sample=nxt)
    assert torch.allclose(logp, flow_grpo_reference(v, x, nxt, 0.7, k), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k", [0, 2, 4])
def test_cps_kernel_against_its_definition(k):
    x, v, nxt = states(k)
    _, logp = sde_transition("cps", v, x, 0.8, SIGMAS, k, prev_sample=nxt)
    assert torch.allclose(logp, cps_reference(v, x, nxt, 0.8, k), rtol=1e-12, atol=1e-12)


def test_per_sample_transitions_match_scalar_ones():
    x, v, nxt = states(5)
    ks = torch.tensor([0, 3, 1])
    for sde_type in SDE_TYPES:
        _, batched = sde_transition(sde_type, v, x, 0.6, SIGMAS, ks, prev_sample=nxt)
        one = [sde_transition(sde_type, v[i:i + 1], x[i:i + 1], 0.6, SIGMAS, int(k), prev_sample=nxt[i:i + 1])[1]
               for i, k in enumerate(ks)]
        assert torch.allclose(batched, torch.cat(one), rtol=1e-12), sde_type


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_each_kernel_rescores_its_own_draw_with_ratio_one(sde_type):
    x, v, _ = states(7)
    drawn, logp = sde_transition(sde_type, v, x, 0.8, SIGMAS, 2, generator=torch.Generator().manual_seed(1))
    _, again = sde_transition(sde_type, v, x, 0.8, SIGMAS, 2, prev_sample=drawn)
    assert torch.equal(torch.exp(again - logp), torch.ones_like(logp))
    # and another output gives another log-prob
    _, other = sde_transition(sde_type, v + 0.1, x, 0.8, SIGMAS, 2, prev_sample=drawn)
    assert not torch.allclose(other, logp)


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_a_draw_with_given_noise_is_the_kernels_own_draw(sde_type):
    """Evaluation draws each image's noise with its own generator and hands it to the kernel
    (Kernel.draw): the same next state, bit for bit, as the rollout's draw of that noise."""
    from dancegrpo.algo.kernels import get_kernel
    x, v, _ = states(5)
    x, v, sigmas = x.float(), v.float(), SIGMAS.float()   # float32, as the models sample
    for k in range(len(sigmas) - 2):
        drawn, logp = sde_transition(sde_type, v, x, 0.8, sigmas, k, generator=torch.Generator().manual_seed(4))
        noise = torch.randn(drawn.shape, generator=torch.Generator().manual_seed(4), dtype=drawn.dtype)
        given, given_logp = get_kernel(sde_type).draw(v, x, 0.8, sigmas, k, noise)
        assert torch.equal(given, drawn) and torch.equal(given_logp, logp), k


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_bf16_outputs_rescore_their_rollout_draws_with_ratio_exactly_one(sde_type):
    """GPU autocast gives bf16 model outputs. The rollout draws each sample at its transition (an int
    index, a chunk at a time); the update re-scores a micro-batch of samples at DIFFERENT transitions
    with one call (index [B]). Both must do the same arithmetic: per-sample sigma tensors would round
    flux_step's sigma * v in float32 instead of bf16 (|log ratio| ~1e-5 for dance)."""
    g = torch.Generator().manual_seed(3)
    ks = torch.tensor([0, 3, 1, 5, 3])
    x = torch.randn(len(ks), 16, 64, generator=g, dtype=torch.float64).float()
    v = torch.randn(len(ks), 16, 64, generator=g).bfloat16()
    drawn = [sde_transition(sde_type, v[i:i + 1], x[i:i + 1], 0.7, SIGMAS.float(), int(k), generator=g)
             for i, k in enumerate(ks)]
    rollout_next, rollout_logp = (torch.cat(parts) for parts in zip(*drawn))
    _, update_logp = sde_transition(sde_type, v, x, 0.7, SIGMAS.float(), ks, prev_sample=rollout_next)
    assert update_logp.dtype == torch.float32
    assert torch.equal(torch.exp(update_logp - rollout_logp), torch.ones(len(ks)))


def test_ode_is_euler():
    x, v, _ = states(3)
    assert torch.allclose(ode_transition(v, x, SIGMAS, 1), x + v * (SIGMAS[2] - SIGMAS[1]), rtol=1e-15)


# ---------------------------------------------------------------- the windowed sampler (tiny Flux)

def rollout_of(make_args, *argv, noise_seed=0, step=1):
    import dancegrpo.train_grpo_flux as flux
    args = make_args(*FAST, *argv)
    ctx = trainer.setup(args, flux.FAMILY(args))
    ctx.step = step
    cond, captions = trainer.expand_groups(args, next(ctx.loader))
    ro = trainer.sample_reference_model(ctx, cond, captions, torch.Generator().manual_seed(noise_seed))
    ctx.counter.remove()
    return ro, ctx, cond


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_ode_outside_the_window_is_deterministic_sde_inside_is_not(make_args, sde_type):
    ro, ctx, cond = rollout_of(make_args, "--sde_type", sde_type, "--eta", "0.7")
    z = ro.latents[:, 0]
    with torch.no_grad():
        runs = [trainer.run_sample_step(ctx, z, cond, torch.Generator().manual_seed(s), window=(2, 4))
                for s in (0, 1, 0)]
    (_, a, la, va), (_, b, lb, _), (_, c, _, _) = runs
    assert torch.equal(a, c)                                   # same noise: same trajectory
    assert torch.equal(a[:, :3], b[:, :3])                     # ODE up to the window: no noise drawn
    assert not torch.allclose(a[:, 3], b[:, 3])                # the window's SDE draws differ
    assert (la[:, :2] == 0).all() and (la[:, 4:] == 0).all() and (la[:, 2:4] != 0).all()
    # outside the window the step is Euler with the model's own output: x' = x + v (sigma' - sigma)
    k = 5
    assert torch.allclose(a[:, k + 1], a[:, k] + va[:, k] * (ctx.sigmas[k + 1] - ctx.sigmas[k]), atol=1e-6)


def test_rollout_records_the_window_and_scores_only_it(make_args):
    ro, _, _ = rollout_of(make_args, "--sde_window_size", "2", "--sde_window_range", "2", "4")
    assert ro.window_start.tolist() == [2] * 8                 # [2, 4 - 2]: always 2
    assert (ro.log_probs[:, 2:4] != 0).all() and (ro.log_probs[:, :2] == 0).all() and (ro.log_probs[:, 4:] == 0).all()


def test_the_banner_counts_the_windows_transitions(make_args):
    _, ctx, _ = rollout_of(make_args, "--sde_window_size", "2", "--sde_window_range", "2", "4")
    assert "2 trained transitions/sample" in trainer.describe(ctx)   # not int(7 x 0.6) = 4


def test_window_draws_vary_over_steps_and_are_seeded(make_args):
    window = ["--sde_window_size", "2", "--sde_window_range", "0", "7", "--sample_batch_size", "2"]
    starts = [rollout_of(make_args, *window, step=s)[0].window_start.tolist() for s in (1, 2, 3)]
    again = rollout_of(make_args, *window, step=1)[0].window_start.tolist()
    assert again == starts[0]                                          # resumable: (seed, step, rank) seeded
    assert all(0 <= s <= 5 for row in starts for s in row)
    assert len({s for row in starts for s in row}) > 1                # the window moves
    assert all(row[i] == row[i + 1] for row in starts for i in range(0, 8, 2))   # one per sampling batch


def test_bad_window_flags_are_refused(make_args):
    with pytest.raises(SystemExit):
        make_args("--sde_window_size", "3", "--sde_window_range", "0", "2")
    with pytest.raises(SystemExit):
        make_args("--sde_window_size", "2", "--sde_window_range", "0", "8")   # S 8: B <= 7
    with pytest.raises(SystemExit):
        make_args("--advantage", "flow_grpo", "--no-use_group")


# ---------------------------------------------------------------- advantages

def test_flow_grpo_advantages_written_out():
    r = torch.tensor([1.0, 2.0, 4.0, 0.0, 0.0, 3.0])
    got = advantages.flow_grpo_advantages(r, 3)
    g1, g2 = [1.0, 2.0, 4.0], [0.0, 0.0, 3.0]
    def pop_std(xs):
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
    want = [(x - sum(g1) / 3) / (pop_std(g1) + 1e-4) for x in g1] + [(x - 1.0) / (pop_std(g2) + 1e-4) for x in g2]
    assert torch.allclose(got, torch.tensor(want), rtol=1e-6)
    glob = advantages.flow_grpo_advantages(r, 3, all_rewards=torch.cat([r, torch.tensor([10.0])]))
    all_std = pop_std([1.0, 2.0, 4.0, 0.0, 0.0, 3.0, 10.0])
    assert torch.allclose(glob, torch.tensor([(x - sum(g1) / 3) / (all_std + 1e-4) for x in g1]
                                              + [(x - 1.0) / (all_std + 1e-4) for x in g2]), rtol=1e-6)


# ---------------------------------------------------------------- training only the window

def one_step(make_args, jagg=None, *argv):
    import dancegrpo.train_grpo_flux as flux
    from jagg_patch import apply_jagg, revert_jagg
    if jagg:
        apply_jagg(trainer_module=flux, **jagg)
    try:
        args = make_args(*FAST, *argv)
        ctx = trainer.setup(args, flux.FAMILY(args))
        ctx.step = 1
        record = flux.train_one_step(ctx)
        ctx.counter.remove()
        return record
    finally:
        revert_jagg()


@pytest.mark.parametrize("sde_type", SDE_TYPES)
@pytest.mark.parametrize("window", [2, 3])
def test_only_window_transitions_are_trained(make_args, sde_type, window):
    flags = ["--sde_window_size", str(window), "--sde_window_range", "0", "6", "--sde_type", sde_type, "--eta", "0.7",
             "--advantage", "flow_grpo"]
    vanilla = one_step(make_args, None, *flags)
    samples = vanilla["samples"]
    assert vanilla["transformer_backwards"] == window * samples and vanilla["train_timesteps"] == window
    jagg = one_step(make_args, dict(window=4, jagg_frac=0.6), *flags)
    assert jagg["transformer_backwards"] == 2 * samples          # K 3 -> 2; K 2 is exact: 2 as well
    assert jagg["jagg_groups"] == samples
    middles = window - 2
    assert jagg["transformer_forwards_reused"] == middles * samples   # on-policy: the window's middles
    assert math.isfinite(jagg["loss"]) and math.isfinite(vanilla["loss"])


# ---------------------------------------------------------------- the KL term

def test_kl_gradient_against_float64_reference(make_args):
    """Policy = base + a perturbation; reference = the frozen base copy. The gradient of PPO + beta KL
    against upstream's per-step loss written out plus beta mean((mu - mu_ref)^2) / (2 std^2)."""
    from helpers import float64_setup, reference_loss, reference_step_velocity
    beta = 0.3
    args, ctx, cond, rollout, adv = float64_setup(make_args, 3, "--kl_beta", str(beta))
    ref_model = ctx.reference.model.double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in ctx.transformer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    n = adv.numel()
    steps = grpo.choose_train_steps(n, args.sampling_steps - 1, 4, torch.Generator().manual_seed(1))
    normaliser = args.gradient_accumulation_steps * 4
    params = [p for p in ctx.transformer.parameters() if p.requires_grad]

    def mean_of(v, b, k):
        s, s1 = float(ctx.sigmas[k]), float(ctx.sigmas[k + 1])
        z = rollout.latents[b:b + 1, k]
        x0 = z - s * v
        return z + (s1 - s) * (v + 0.5 * args.eta ** 2 * (z - (1 - s) * x0) / s ** 2), args.eta * math.sqrt(s - s1)

    kl = 0.0
    for b in range(n):
        for k in steps[b].tolist():
            mu, std = mean_of(reference_step_velocity(ctx.transformer, rollout, cond, b, k, ctx.sigmas, args), b, k)
            with torch.no_grad():
                mu_ref, _ = mean_of(reference_step_velocity(ref_model, rollout, cond, b, k, ctx.sigmas, args), b, k)
            kl = kl + ((mu - mu_ref) ** 2).mean() / (2 * std ** 2)
    total = reference_loss(ctx.transformer, rollout, cond, adv, steps, ctx.sigmas, args, normaliser) + beta * kl / normaliser
    ref = torch.autograd.grad(total, params, retain_graph=True)
    for p in params:
        p.grad = None
    trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), steps, normaliser, grpo.policy_update)
    num = sum(((p.grad - r) ** 2).sum() for p, r in zip(params, ref)).sqrt()
    den = sum((r ** 2).sum() for r in ref).sqrt()
    # 2.1e-9 measured: the reference feeds the decimal timesteps int(1000 sigma) / 1000, the trainer
    # their float32 values (the same 3.6e-8 effect is noted for LoRA); float32 rounding would be 1e-7
    assert (num / den).item() < 1e-8
    kl_part = torch.autograd.grad(beta * kl / normaliser, params, allow_unused=True)
    assert sum(float(x.norm()) for x in kl_part if x is not None) > 1e-3 * float(den)   # the KL term matters


def test_kl_at_the_reference_changes_nothing(make_args):
    """Policy == reference: the KL term and its gradient are exactly 0, so beta > 0 gives exactly
    the plain loss and gradient."""
    from helpers import float64_setup

    def grads(*extra):
        args, ctx, cond, rollout, adv = float64_setup(make_args, 3, *extra)
        if ctx.reference is not None:
            ctx.reference.model.double()
        steps = grpo.choose_train_steps(adv.numel(), args.sampling_steps - 1, 4, torch.Generator().manual_seed(1))
        stats = trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(adv.numel()), steps, 32,
                                                   grpo.policy_update)
        return torch.cat([p.grad.reshape(-1) for p in ctx.transformer.parameters()]), stats.loss

    plain, plain_loss = grads()
    with_kl, kl_loss = grads("--kl_beta", "0.5")
    assert torch.equal(plain, with_kl) and plain_loss == kl_loss


def test_kl_with_lora_uses_the_disabled_adapter(make_args):
    args = make_args(*FAST, "--kl_beta", "0.1", "--use_lora", "--lora_rank", "4", "--lora_alpha", "8")
    import dancegrpo.train_grpo_flux as flux
    ctx = trainer.setup(args, flux.FAMILY(args))
    reference = ctx.reference
    assert reference.model is ctx.transformer and reference.lora_raw is ctx.raw_transformer   # no copy
    z = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    cond, _ = trainer.expand_groups(args, next(ctx.loader))
    cond = {k: v[:2] for k, v in cond.items()}
    t = ctx.timesteps[1].expand(2)
    with torch.no_grad():
        for name, p in ctx.raw_transformer.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)                          # the adapter now changes the output
        policy = predict_velocity(ctx, z, t, cond)
        base = reference(z, t, cond)
        after = predict_velocity(ctx, z, t, cond)
    assert not torch.allclose(policy, base)
    assert torch.equal(policy, after)                # the adapter is back on afterwards
    ctx.counter.remove()


# ---------------------------------------------------------------- end to end, every kernel

@pytest.mark.slow
@pytest.mark.parametrize("sde_type", SDE_TYPES)
@pytest.mark.parametrize("jagg", [False, True], ids=["vanilla", "jagg"])
def test_tiny_end_to_end_every_kernel(cache_dir, tmp_path, capsys, sde_type, jagg):
    """The command line of each kernel, vanilla and through the JAGG launcher (in this process:
    helpers.run_main)."""
    assert run_main(*(["jagg_patch"] if jagg else []), "dancegrpo.train_grpo_flux", "--preset", "tiny",
             "--cache_dir", cache_dir, "--output_dir", tmp_path, "--max_train_steps", "2", *FAST,
             "--sampling_steps", "6", "--sde_window_size", "3", "--sde_window_range", "0", "3", "--sde_type", sde_type,
             "--eta", "0.8", "--advantage", "flow_grpo", "--kl_beta", "0.01") == 0
    stdout = capsys.readouterr().out
    records = read_metrics(tmp_path)
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)
    assert all(r["transformer_backwards"] == (2 if jagg else 3) * r["samples"] for r in records)
    if jagg:
        assert "the 3 transitions of each sample's SDE window (Flow-GRPO-Fast)" in stdout
