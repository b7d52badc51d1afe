"""Loop code that touches gradients, as research loops write it (GRPO_LOOPS.md section 6): a clip bound
before the proxy existed, torch's two-step clip, a model's own clip on its instance, a grad-norm log, a
NaN check that skips the step, zero_grad of the model or the proxy, backward(inputs=...), a parameter
frozen or thawed mid-run. Each runs the same float64 loop with and without the proxy (mode exact, so
the deferred gradient is vanilla's): the values the loop's code computed and the weights after its
optimizer steps must be vanilla's, to float64 rounding; what cannot be served stops in one line."""
import functools
import gc
import types

import pytest
import torch
from torch.nn.utils import clip_grad_norm_   # bound before any proxy exists, as a script's top line binds it

from deferred_loops import DT, LOOPS, Log, Setting, Velocity, advantages_of, capture_grads, gaussian_step, ppo
from deferred_loops import reference_gradients
from helpers import relative_error
from jagg_patch import JaggConfig
from jagg_patch import deferred
from jagg_patch.deferred import DeferredError

SETTING = Setting(prompts=2, generations=2, steps=6, trained=3, accumulation=2)   # two optimizer steps
MAX_NORM = 0.05


class Code:
    """The loop's own code at its three places: before the update, each backward (n: the call's index),
    the optimizer step (returns whether to step). `record` keeps what it computed."""

    def __init__(self):
        self.record = []

    def before_update(self, model, net):
        pass

    def backward(self, loss, model, net, n):
        loss.backward()

    def at_step(self, model, net, optimizer):
        return True


def grpo_loop(model, net, optimizer, code, s=SETTING, seed=0):
    """DanceGRPO Flux's shape: a rollout under no_grad, then one sample per call, loss.backward() at
    once, an optimizer step every `accumulation` samples; `model` is what the loop calls (the proxy or
    the model), `net` the model itself."""
    g = torch.Generator().manual_seed(seed)
    sigmas, (cond, _) = s.sigmas(), s.embeddings()

    def velocity(i, k, x):
        return model(hidden_states=x, timestep=sigmas[k].reshape(1), encoder_hidden_states=cond[i:i + 1]).sample

    traj, old = [], []
    with torch.no_grad():
        for i in range(s.samples):
            z, lps = [torch.randn(1, s.tokens, s.channels, generator=g, dtype=DT)], []
            for k in range(s.steps):
                nxt, lp = gaussian_step(z[k], velocity(i, k, z[k]), float(sigmas[k]), float(sigmas[k + 1]), s.eta,
                                        generator=g)
                z.append(nxt)
                lps.append(lp - 0.05)
            traj.append(z)
            old.append(lps)
    adv = advantages_of(torch.cat([z[-1] for z in traj]), s)
    perms = [torch.randperm(s.steps - 1, generator=g)[:s.trained].tolist() for _ in range(s.samples)]
    code.before_update(model, net)
    n = 0
    for i in range(s.samples):
        for k in perms[i]:
            _, logp = gaussian_step(traj[i][k], velocity(i, k, traj[i][k]), float(sigmas[k]), float(sigmas[k + 1]),
                                    s.eta, prev=traj[i][k + 1])
            code.backward(ppo(logp, old[i][k], adv[i], s).mean() / (s.accumulation * s.trained), model, net, n)
            n += 1
        if (i + 1) % s.accumulation == 0:
            if code.at_step(model, net, optimizer):
                optimizer.step()
            optimizer.zero_grad()


def weights(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def run(code_of, through_proxy, config=JaggConfig(mode="exact"), net_of=Velocity, lr=0.5):
    """(the weights after the loop, what its code recorded, the proxy's flushes)."""
    net = net_of()
    model = deferred.wrap(net, config) if through_proxy else net
    code = code_of()
    try:
        grpo_loop(model, net, torch.optim.SGD(net.parameters(), lr=lr), code)
    finally:
        if through_proxy:
            model.close()
    return weights(net), code.record, (model.stats if through_proxy else None)


def assert_as_vanilla(code_of, **options):
    """The deferred run's weights and recorded values equal vanilla's; returns the deferred run's flushes."""
    plain_weights, plain_record, _ = run(code_of, False, **options)
    got_weights, got_record, stats = run(code_of, True, **options)
    assert torch.isfinite(plain_weights).all()
    assert relative_error(got_weights, plain_weights) < 1e-12
    assert len(got_record) == len(plain_record) and plain_record
    for got, plain in zip(got_record, plain_record):
        assert got == pytest.approx(plain, rel=1e-12, abs=1e-300), (got_record, plain_record)
    return stats


# ---------------------------------------------------------------- 1. clips however they were bound

class ClipImportedBefore(Code):
    def at_step(self, model, net, optimizer):
        self.record.append(float(clip_grad_norm_(model.parameters(), MAX_NORM)))
        return True


class TwoStepClip(Code):
    def at_step(self, model, net, optimizer):
        params = list(model.parameters())
        total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total)
        self.record.append(float(total))
        return True


def hand_clip(module, max_norm):
    """A clip written by hand (as FSDP's own method computes its norm, not through torch's function)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    total = torch.sqrt(sum((g * g).sum() for g in grads))
    for g in grads:
        g.mul_(min(1.0, max_norm / (float(total) + 1e-6)))
    return total


class ModelClip(Code):
    def at_step(self, model, net, optimizer):
        self.record.append(float(model.clip_grad_norm_(MAX_NORM)))
        return True


def with_instance_clip():
    net = Velocity()
    net.clip_grad_norm_ = types.MethodType(hand_clip, net)
    return net


class ClipAssigningWrapper(torch.nn.Module):
    """A wrapper that assigns its clip in __init__ (as a training framework's model wrapper may)."""

    def __init__(self):
        super().__init__()
        self.module = Velocity()
        self.clip_grad_norm_ = functools.partial(hand_clip, self)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_a_clip_imported_before_the_proxy_clips_vanillas_gradient():
    assert_as_vanilla(ClipImportedBefore)


@pytest.mark.skipif(not hasattr(torch.nn.utils, "clip_grads_with_norm_"),
                    reason="torch.nn.utils.get_total_norm / clip_grads_with_norm_ need torch >= 2.6")
def test_torchs_two_step_clip_sees_vanillas_gradient():
    assert_as_vanilla(TwoStepClip)


@pytest.mark.parametrize("net_of", [with_instance_clip, ClipAssigningWrapper], ids=["method-type", "wrapper-assigns"])
def test_a_models_own_clip_on_its_instance_sees_vanillas_gradient(net_of):
    assert_as_vanilla(ModelClip, net_of=net_of)


# ---------------------------------------------------------------- 2. zero_grad of the model or the proxy

class DiscardedPass(Code):
    """A pass in grad mode before the update whose gradient the loop throws away with `how`."""
    how = None

    def before_update(self, model, net):
        x = torch.full((1, SETTING.tokens, SETTING.channels), 0.3, dtype=DT)
        out = model(hidden_states=x, timestep=torch.tensor([0.5], dtype=DT),
                    encoder_hidden_states=torch.ones(1, SETTING.text_tokens, 3, dtype=DT)).sample
        out.pow(2).sum().backward()
        {"model": net, "proxy": model}[self.how].zero_grad()

    def at_step(self, model, net, optimizer):
        self.record.append(float(clip_grad_norm_(net.parameters(), 1e9)))
        return True


@pytest.mark.parametrize("how", ["model", "proxy"])
def test_zero_grad_of_the_model_or_the_proxy_drops_the_pending_rows(how):
    stats = assert_as_vanilla(type("Discarded", (DiscardedPass,), {"how": how}))
    first = stats[0]
    assert first.rows_dropped == 1 and first.rows_deferred == SETTING.accumulation * SETTING.trained


# ---------------------------------------------------------------- 3. backward(inputs=...)

class BackwardOnParameters(Code):
    def backward(self, loss, model, net, n):
        loss.backward(inputs=list(net.parameters()))

    def at_step(self, model, net, optimizer):
        self.record.append(float(clip_grad_norm_(net.parameters(), 1e9)))
        return True


def test_backward_with_inputs_naming_every_parameter_is_vanillas():
    assert_as_vanilla(BackwardOnParameters)


def test_backward_naming_some_parameters_and_autograd_grad_are_refused_in_one_line():
    class Some(Code):
        def backward(self, loss, model, net, n):
            loss.backward(inputs=[net.w_out])

    class AutogradGrad(Code):
        def backward(self, loss, model, net, n):
            torch.autograd.grad(loss, list(net.parameters()), allow_unused=True)

    for code, said in ((Some, r"backward\(inputs=\.\.\.\) names 1 of the 5 parameters"),
                       (AutogradGrad, r"torch.autograd.grad of the model's parameters through a deferred call")):
        with pytest.raises(DeferredError, match=said) as refused:
            run(code, True)
        assert "\n" not in str(refused.value)


# ---------------------------------------------------------------- 4. reading .grad between backward and step

class LoggedNorm(Code):
    def at_step(self, model, net, optimizer):
        self.record.append(float(torch.sqrt(sum((p.grad ** 2).sum() for p in net.parameters() if p.grad is not None))))
        return True


class SkipsNonFinite(Code):
    """One call's loss is NaN (the first accumulation's): vanilla's check skips that step."""
    every_parameter = False

    def backward(self, loss, model, net, n):
        (loss * float("nan") if n == 1 else loss).backward()

    def at_step(self, model, net, optimizer):
        if self.every_parameter:
            finite = all(bool(torch.isfinite(p.grad).all()) for p in net.parameters())
        else:
            grads = [p.grad for p in net.parameters() if p.grad is not None]
            finite = all(bool(torch.isfinite(g).all()) for g in grads)
        self.record.append(finite)
        return finite


def test_a_grad_norm_read_before_the_step_is_vanillas():
    assert_as_vanilla(LoggedNorm)


@pytest.mark.parametrize("every_parameter", [False, True], ids=["listed-if-not-none", "isfinite-of-each"])
def test_a_step_skipped_on_a_non_finite_gradient_is_skipped_as_vanilla_skips_it(every_parameter):
    code = type("Skips", (SkipsNonFinite,), {"every_parameter": every_parameter})
    assert_as_vanilla(code)
    assert run(code, True)[1] == [False, True]


# ---------------------------------------------------------------- 5. a proxy of a proxy

def test_a_proxy_of_a_proxy_is_refused_in_one_line():
    proxy = deferred.wrap(Velocity(), JaggConfig())
    try:
        with pytest.raises(DeferredError, match="a deferred proxy already .* wrap the model once"):
            deferred.wrap(proxy, JaggConfig())
    finally:
        proxy.close()


# ---------------------------------------------------------------- 6. a Python float timestep

@pytest.mark.parametrize("form", ["float", "mixed"])
def test_a_float_timestep_places_the_rows_and_gives_float64_alphas(form):
    """Floats in the rollout and the update, or a float in the rollout and a 0-d float64 tensor in the
    update: every row placed, the gradient the JAGG reference's to 1e-12."""
    setting, config = Setting(timesteps=form), JaggConfig(window=4, jagg_frac=1.0)
    net = Velocity()
    proxy = deferred.wrap(net, config)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    log = Log()
    capture_grads(optimizer, list(net.parameters()), log)
    try:
        LOOPS["flux"](proxy, optimizer, setting, log, torch.Generator().manual_seed(0))
    finally:
        proxy.close()
    assert proxy.stats[0].exact_rows == 0 and proxy.stats[0].jagg_groups == setting.samples
    ref = reference_gradients(Velocity(), "flux", setting, config, 0)
    assert relative_error(log.grads[0], ref[0]) < 1e-12


# ---------------------------------------------------------------- 7. freezing and thawing

def freeze(net, frozen):
    net.adapter.requires_grad_(not frozen)


class FrozenBeforeTheStep(Code):
    """The adapter frozen after the first accumulation's calls, before its step: vanilla's step still
    updates it (its .grad is there); the second accumulation does not train it."""

    def at_step(self, model, net, optimizer):
        freeze(net, True)
        self.record.append(float(clip_grad_norm_(net.parameters(), 1e9)))
        return True


class FrozenBetweenCalls(Code):
    """Frozen after the second call, thawed after the fifth (as a partly frozen run may)."""

    def backward(self, loss, model, net, n):
        loss.backward()
        if n in (1, 4):
            freeze(net, n == 1)

    def at_step(self, model, net, optimizer):
        self.record.append(float(clip_grad_norm_(net.parameters(), 1e9)))
        return True


@pytest.mark.parametrize("code", [FrozenBeforeTheStep, FrozenBetweenCalls], ids=["before-the-step", "between-calls"])
def test_a_parameter_frozen_mid_run_gets_what_vanilla_gives_it(code):
    assert_as_vanilla(code)


class FrozenAfterSecondCall(Code):
    def backward(self, loss, model, net, n):
        loss.backward()
        if n == 1:
            freeze(net, True)


def test_a_group_whose_calls_had_different_parameters_trainable_is_trained_exactly():
    """W 3 over a sample's three rows, the adapter frozen after the first sample's second call: no
    endpoint stands for the rows on both sides, so that sample's rows train exactly (counted); the
    second sample's, all called frozen, are grouped."""
    _, _, stats = run(FrozenAfterSecondCall, True, config=JaggConfig(window=3, jagg_frac=1.0, reuse="off"), lr=0.0)
    first = stats[0]
    assert first.rows_exact == {"requires_grad changed": SETTING.trained} and first.jagg_groups == 1


# ---------------------------------------------------------------- what the proxy leaves behind

def test_a_proxy_dropped_without_close_leaves_nothing_patched():
    from jagg_patch.deferred import hooks
    originals = (torch.autograd.backward, torch.autograd.grad, torch.nn.Module.zero_grad,
                 torch.optim.Optimizer.zero_grad, torch.nn.utils.clip_grad_norm_)
    net = Velocity()
    proxy = deferred.wrap(net, JaggConfig())
    assert "grad" in vars(torch.nn.Parameter) and hooks.installed()
    del proxy, net
    gc.collect()
    assert hooks.installed() == [] and "grad" not in vars(torch.nn.Parameter)
    assert (torch.autograd.backward, torch.autograd.grad, torch.nn.Module.zero_grad,
            torch.optim.Optimizer.zero_grad, torch.nn.utils.clip_grad_norm_) == originals


def test_close_flushes_what_is_pending_and_takes_its_hooks_off_the_model():
    net = Velocity()
    proxy = deferred.wrap(net, JaggConfig(mode="exact"))
    x, t, text = torch.ones(1, 5, 4, dtype=DT), torch.tensor([0.5], dtype=DT), torch.ones(1, 2, 3, dtype=DT)
    proxy(x, t, text).sample.pow(2).sum().backward()
    proxy.close()
    assert not net._forward_hooks and proxy.stats[-1].rows_deferred == 1
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    net(x, t, text).sample.pow(2).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, net.parameters()))   # vanilla's gradient
    assert proxy(x, t, text).sample.requires_grad   # a closed proxy calls the model as it is


def test_a_model_outliving_its_proxy_records_nothing_for_it():
    net = Velocity()
    proxy = deferred.wrap(net, JaggConfig())
    del proxy
    gc.collect()
    with torch.no_grad():
        net(torch.ones(1, 5, 4, dtype=DT), torch.tensor([0.5], dtype=DT), torch.ones(1, 2, 3, dtype=DT))
    assert not net._forward_hooks
