"""The one interface between the loop and whatever holds the model across ranks.

The loop never asks which engine it has: it calls `model` as the transformer, hands `backward`
to the policy update, and calls `optimizer_step`, `full_state`, `save_state`, `load_state` and, at
the end of the run, `close`.
An engine is one module implementing `Engine`, registered in `dancegrpo.engines.ENGINES`.
"""


class Engine:
    """What the loop, the checkpoint and the banner ask of an engine.

    model           the module the loop calls (FSDP-wrapped, a DeepSpeed engine, or the plain model)
    ema_module      the module whose parameters the EMA follows (names without an engine's prefix)
    optimizer, lr_scheduler
    backward        None for torch.autograd.backward, or an engine's own backward(outputs, grads)
    gradient_probe  a measurement's gradients beside the step's own (dancegrpo.engines.probe)
    """
    name = None
    backward = None

    @classmethod
    def validate_args(cls, args):
        """Refuse flags this engine cannot honour, before anything is loaded."""

    @classmethod
    def build(cls, args, family, raw, device, world_size):
        """Wrap the loaded model `raw` and build its optimizer and scheduler."""
        raise NotImplementedError

    def optimizer_step(self, check_norm):
        """Clip, step the optimizer and clear the gradients; `check_norm(norm)` sees the total
        grad norm before clipping (before the step where the engine allows). Returns the norm."""
        raise NotImplementedError

    def full_state(self, trainable_only=False):
        """Unsharded CPU state dict of the model (collective: every rank calls it)."""
        raise NotImplementedError

    def save_state(self, folder):
        """Collective: write the optimizer (and any engine) state into a checkpoint folder."""
        raise NotImplementedError

    def load_state(self, folder, saved):
        """Collective: restore what `save_state` wrote; `saved` is the folder's training_state dict."""
        raise NotImplementedError

    def gradient_probe(self):
        """A probe (dancegrpo.engines.probe) over the trainable parameters: the default reads the
        measurement's gradient from .grad, where this engine's backward leaves it."""
        from .probe import GradProbe
        return GradProbe(p for p in self.model.parameters() if p.requires_grad)

    def close(self):
        """The run is over: release what the engine holds beyond it, before the process group goes
        (default: nothing)."""

    def label(self):
        """How the banner names the engine, e.g. ' (FSDP bf16)'."""
        return ""

    def state_setup(self, adapter):
        """The dancegrpo.utils.state_bytes setup this engine holds the run's training state in
        (`adapter`: dancegrpo.adapters, what is trained)."""
        raise NotImplementedError

    @property
    def weight_type(self):
        return "fp32"


def build_optimizer(args, model):
    """Upstream's AdamW over the trainable parameters and its diffusers scheduler."""
    import torch
    from diffusers.optimization import get_scheduler
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=(0.9, 0.999),
                                  weight_decay=args.weight_decay, eps=1e-8)
    scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps,
                              num_training_steps=1_000_000, num_cycles=args.lr_num_cycles, power=args.lr_power)
    return optimizer, scheduler
