"""The deferred proxy installed where a script prepares its model: accelerate's Accelerator.prepare.

A script whose update loop is inline in its main() (DanceGRPO's SD trainer, Flow-GRPO's trainers) hands
its trained model and its optimizer to `accelerator.prepare` and uses what comes back. While installed,
prepare returns, in place of each model it prepared that has trainable parameters, a proxy of it
(jagg_patch.deferred.wrap), attached to the optimizers prepared for its parameters (in the same call or
another, before or after). The rollout may call the model inside (pipeline.unet, pipeline.transformer):
the proxy's forward hook sees those calls. While installed, `accelerator.unwrap_model(proxy)` unwraps the
model the proxy holds (a script saves through it: `unwrap_model(transformer).save_pretrained(...)`).
accelerate is imported when this is installed, not before.
"""
import functools
from dataclasses import dataclass, field

import torch

from .hooks import real_optimizer
from .proxy import wrap


def _trainable(obj):
    return isinstance(obj, torch.nn.Module) and any(p.requires_grad for p in obj.parameters())


def _optimizer_params(obj):
    """The parameters an optimizer steps (accelerate's wrapper is a torch Optimizer too; a scheduler,
    which holds one, is none); None for anything else."""
    if not isinstance(obj, torch.optim.Optimizer):
        return None
    return {id(p) for group in real_optimizer(obj).param_groups for p in group["params"]}


@dataclass
class Installed:
    """What install_at_prepare did: the proxies made so far; remove() puts prepare back."""
    proxies: list = field(default_factory=list)
    optimizers: list = field(default_factory=list)
    undo: object = None

    def remove(self, flush=True):
        """prepare and unwrap_model put back, each proxy closed (flushing what is pending unless flush=False:
        a run stopping on an error)."""
        if self.undo is not None:
            self.undo(flush)
            self.undo = None

    def _pair(self):
        """Attach every proxy to every optimizer of its parameters it is not attached to yet."""
        for proxy in self.proxies:
            params = {id(p) for p in proxy.wrapped.parameters() if p.requires_grad}
            for optimizer, stepped in self.optimizers:
                key = (id(proxy), id(optimizer))
                if stepped & params and key not in self._attached:
                    proxy.attach(optimizer)
                    self._attached.add(key)

    def __post_init__(self):
        self._attached = set()


def install_at_prepare(config, on_flush=None, on_prepare=None, **options):
    """Patch accelerate.Accelerator.prepare (see the module); `options` go to wrap, `on_flush` (a
    callback fn(proxy, stats)) to each proxy's on_flush, `on_prepare(accelerator)` is called before a
    proxy is made. Returns an Installed."""
    from accelerate import Accelerator
    original, original_unwrap = Accelerator.prepare, Accelerator.unwrap_model
    installed = Installed()

    @functools.wraps(original)
    def prepare(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        single = len(args) + len(kwargs) == 1
        items = [result] if single else list(result)
        for i, item in enumerate(items):
            params = _optimizer_params(item)
            if params is not None:
                installed.optimizers.append((item, params))
            elif _trainable(item):
                if on_prepare is not None:
                    on_prepare(self)
                proxy = wrap(item, config, **options)
                if on_flush is not None:
                    proxy.on_flush.append(on_flush)
                installed.proxies.append(proxy)
                items[i] = proxy
        installed._pair()
        return items[0] if single else tuple(items)

    @functools.wraps(original_unwrap)
    def unwrap_model(self, model, *args, **kwargs):
        # accelerate unwraps what it knows (DDP, compile); the proxy is none of those and would come back
        inner = model.wrapped if any(model is proxy for proxy in installed.proxies) else model
        return original_unwrap(self, inner, *args, **kwargs)

    def undo(flush):
        Accelerator.prepare, Accelerator.unwrap_model = original, original_unwrap
        for proxy in installed.proxies:
            proxy.close(flush=flush)

    Accelerator.prepare, Accelerator.unwrap_model = prepare, unwrap_model
    installed.undo = undo
    return installed
