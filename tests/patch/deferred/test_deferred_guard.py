"""What jagg_patch.deferred refuses and where it flushes: one line for what it cannot serve (dropout,
a model whose output is not a function of its arguments, an argument changed in place, parameters
moved without a flush, DeepSpeed, settings it has no use for), and a flush before every clip and
optimizer step it can see (torch's clip, a model's own clip_grad_norm_, a GradScaler's unscale_,
accelerate's wrapped optimizer and clip), float64 against the loop's JAGG reference."""
import os
import subprocess
import sys

import pytest
import torch

from deferred_loops import LOOPS, Log, Setting, Velocity, capture_grads, reference_gradients
from helpers import REPO_ROOT, relative_error
from jagg_patch import JaggConfig
from jagg_patch import deferred
from jagg_patch.deferred import DeferredError

X = torch.ones(1, 5, 4, dtype=torch.float64)
T = torch.full((1,), 0.5, dtype=torch.float64)
TEXT = torch.ones(1, 2, 3, dtype=torch.float64)


@pytest.fixture
def proxies():
    made = []
    yield made
    for proxy in made:
        proxy.close()


def one_call(proxy, x=X):
    out = proxy(hidden_states=x, timestep=T, encoder_hidden_states=TEXT).sample
    out.pow(2).sum().backward()


class Noisy(Velocity):
    """Its output is not a function of its arguments: a hidden draw in training mode."""

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=True):
        out = super().forward(hidden_states, timestep, encoder_hidden_states, return_dict)
        if self.training:
            out.sample.add_(0.1 * torch.randn_like(out.sample))
        return out


def test_dropout_is_refused_at_wrap():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    model.forward = lambda hidden_states, timestep: hidden_states
    with pytest.raises(DeferredError, match=r"Dropout\(p=0.1\).*set its p to 0"):
        deferred.wrap(model, JaggConfig())


def test_a_replay_that_is_not_the_call_stops_the_run(proxies):
    proxy = deferred.wrap(Noisy(), JaggConfig(mode="exact"))
    proxies.append(proxy)
    proxy.train()
    one_call(proxy)
    with pytest.raises(DeferredError, match=r"differs from its call-time output by .* \(bound .* for float64\)"):
        proxy.flush()


def test_an_argument_changed_in_place_stops_the_run(proxies):
    proxy = deferred.wrap(Velocity(), JaggConfig(mode="exact"))
    proxies.append(proxy)
    x = X.clone()
    one_call(proxy, x)
    x.add_(1.0)
    with pytest.raises(DeferredError, match=r"changed the argument\(s\) \['hidden_states'\] .* in place"):
        proxy.flush()


def test_parameters_moved_without_a_flush_stop_the_run(proxies):
    """The parameters changed under pending rows (an update the proxy was not told of: weights loaded,
    an EMA swapped in): the flush refuses to replay them."""
    model = Velocity()
    proxy = deferred.wrap(model, JaggConfig(mode="exact"))
    proxies.append(proxy)
    one_call(proxy)
    with torch.no_grad():
        model.w_out.add_(0.01)
    with pytest.raises(DeferredError, match="weights changed in place between a deferred call .*proxy.flush"):
        proxy.flush()


def test_deepspeed_and_settings_without_use_are_refused():
    engine = type("DeepSpeedEngine", (Velocity,), {})()
    with pytest.raises(DeferredError, match="does not drive a DeepSpeed engine"):
        deferred.wrap(engine, JaggConfig())
    for config, match in ((JaggConfig(grouping="window"), "window grouping"),
                          (JaggConfig(jagg_frac="auto", monitor_every=2), "no fidelity monitor")):
        with pytest.raises(DeferredError, match=match):
            deferred.wrap(Velocity(), config)


def test_arguments_it_cannot_tell_apart_are_refused():
    class PassOn(torch.nn.Module):   # forward(*args, **kwargs) around nothing it can bind to
        def forward(self, *args, **kwargs):
            return args[0]

    with pytest.raises(DeferredError, match="takes only \\*args / \\*\\*kwargs.*signature_of"):
        deferred.wrap(PassOn(), JaggConfig())

    class Unnamed(torch.nn.Module):
        def forward(self, x, sigma, cond):
            return x

    with pytest.raises(DeferredError, match="no argument named like a timestep.*timestep=NAME"):
        deferred.wrap(Unnamed(), JaggConfig())
    deferred.wrap(Unnamed(), JaggConfig(), timestep="sigma").close()


def test_a_model_clip_method_flushes_first(proxies):
    """FSDP's transformer.clip_grad_norm_ (here a wrapper's) sees the replayed gradient, whether the
    loop calls it through the proxy or on the model it holds."""
    class WithClip(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = Velocity()

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        def clip_grad_norm_(self, max_norm):   # the norm only, by hand (torch's get_total_norm needs torch >= 2.6)
            return torch.sqrt(sum((p.grad ** 2).sum() for p in self.parameters() if p.grad is not None))

    model = WithClip()
    proxy = deferred.wrap(model, JaggConfig(mode="exact"))
    proxies.append(proxy)
    one_call(proxy)
    assert float(proxy.clip_grad_norm_(1.0)) > 0
    one_call(proxy)
    assert float(model.clip_grad_norm_(1.0)) > 0 and proxy.stats[-1].rows_deferred == 1


def test_grad_scaler_unscale_flushes_first(proxies):
    """With a GradScaler the signals arrive scaled; the flush runs before unscale_, so the unscaled
    gradient is the loop's JAGG gradient."""
    setting, config = Setting(), JaggConfig(window=4, jagg_frac=1.0)
    model = Velocity()
    proxy = deferred.wrap(model, config)
    proxies.append(proxy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    proxy.attach(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    log = Log()
    capture_grads(optimizer, list(model.parameters()), log)

    class Scaled:   # the loop's loss.backward() runs as scaler.scale(loss).backward(), its step as scaler.step
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self):
            scaler.unscale_(self.optimizer)
            scaler.step(self.optimizer)
            scaler.update()

        def zero_grad(self):
            self.optimizer.zero_grad()

    backward = torch.Tensor.backward
    torch.Tensor.backward = lambda loss, *a, **k: backward(scaler.scale(loss), *a, **k)
    try:
        LOOPS["flux"](proxy, Scaled(optimizer), setting, log, torch.Generator().manual_seed(0), clip="none")
    finally:
        torch.Tensor.backward = backward
    ref = reference_gradients(Velocity(), "flux", setting, config, 0)
    assert relative_error(log.grads[0], ref[0]) < 1e-12


def test_accelerate_wrapped_optimizer_and_clip():
    """accelerate's AcceleratedOptimizer (no torch optimizer itself: the real one is its .optimizer)
    and accelerator.clip_grad_norm_, as Flow-GRPO and DanceGRPO's SD trainer drive them: the clip sees
    the JAGG gradient, and the step steps it."""
    from accelerate import Accelerator
    setting = Setting()
    config = JaggConfig(window=4, jagg_frac=1.0)
    accelerator = Accelerator(cpu=True)
    model = Velocity()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, wrapped = accelerator.prepare(model, optimizer)
    proxy = deferred.wrap(model, config).attach(wrapped)
    log, norms = Log(), []
    capture_grads(optimizer, list(model.parameters()), log)

    class Loop:   # the loop's clip and step, through accelerate
        def step(self):
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1e9)))
            wrapped.step()

        def zero_grad(self):
            wrapped.zero_grad()

    try:
        LOOPS["sd"](proxy, Loop(), setting, log, torch.Generator().manual_seed(0), clip="none")
    finally:
        proxy.close()
    ref = reference_gradients(Velocity(), "sd", setting, config, 0)
    assert len(log.grads) == len(ref) == 1 and relative_error(log.grads[0], ref[0]) < 1e-12
    assert norms[0] == pytest.approx(float(ref[0].norm()), rel=1e-12)


def test_the_package_loads_without_dancegrpo_diffusers_or_accelerate():
    code = ("import sys, jagg_patch.deferred; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'dancegrpo', 'diffusers', 'accelerate'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                         env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_install_at_prepare_wraps_the_model_and_attaches_its_optimizer_once():
    """accelerate's prepare with a model, its optimizer and a scheduler (which holds the optimizer but is
    none): the model comes back as a proxy attached to the optimizer once; the rest as accelerate gives it."""
    from accelerate import Accelerator
    from jagg_patch.deferred.prepare import install_at_prepare
    installed = install_at_prepare(JaggConfig())
    try:
        model = Velocity()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        proxy, wrapped, prepared_scheduler = Accelerator(cpu=True).prepare(model, optimizer, scheduler)
        assert isinstance(proxy, deferred.DeferredModel) and proxy.wrapped is model
        assert not isinstance(prepared_scheduler, deferred.DeferredModel) and installed.proxies == [proxy]
        assert proxy._optimizers == [optimizer]
        # a script saves through accelerate's unwrap: it gets the model, not the proxy (which it got before)
        assert Accelerator(cpu=True).unwrap_model(proxy) is model
    finally:
        installed.remove()
    assert Accelerator.unwrap_model(Accelerator(cpu=True), model) is model   # put back


def test_an_fsdp2_model_is_told_apart_where_fsdp2_lives_in_composable(monkeypatch):
    """torch 2.5 keeps FSDP2's FSDPModule in torch.distributed._composable.fsdp only: a model holding one
    is still replayed as a sharded model (every rank runs as many chunks), not as a plain one."""
    import types
    from torch.distributed.fsdp import FullyShardedDataParallel
    from jagg_patch.deferred.replay import _kind

    class FSDPModule:   # stands for torch 2.5's class
        pass

    fsdp = types.ModuleType("torch.distributed.fsdp")
    fsdp.FullyShardedDataParallel = FullyShardedDataParallel   # no FSDPModule there
    composable = types.ModuleType("torch.distributed._composable.fsdp")
    composable.FSDPModule = FSDPModule
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", fsdp)
    monkeypatch.setitem(sys.modules, "torch.distributed._composable.fsdp", composable)
    assert _kind(type("Sharded", (Velocity, FSDPModule), {})()) == "collective"
    assert _kind(Velocity()) == "plain"
