"""The two kinds of what is trained: the full weights, or a LoRA adapter (--use_lora), each with the
frozen reference of its KL term. The setup asks the run's adapter, never which one it has."""
from ..utils.checkpoint import FullWeights
from .lora import LoraWeights, add_lora
from .reference import Reference, frozen_copy


class FullModel:
    """A full fine-tune: every weight trains; checkpoints hold the full transformer."""
    memory_setup = "fsdp"   # dancegrpo.utils.state_bytes: what one rank holds under FSDP

    def __init__(self, args, family):
        self.weights_format = FullWeights()
        self._frozen = None

    def attach(self, raw, args, seed):
        """Before any wrapping. The KL reference is the weights as loaded: a frozen copy, taken now."""
        if args.kl_beta > 0:
            self._frozen = frozen_copy(raw)

    def reference(self, run, model, raw, device):
        return Reference(run, self._frozen.to(device))

    def describe(self, args, num_trainable):
        return ""


class LoraAdapter:
    """--use_lora: the base weights frozen, one peft adapter trained; the KL reference is the
    model itself with its adapter switched off."""
    memory_setup = "lora"

    def __init__(self, args, family):
        self.weights_format = LoraWeights(args, family.pipeline_class_name)

    def attach(self, raw, args, seed):
        add_lora(raw, args, seed)

    def reference(self, run, model, raw, device):
        return Reference(run, model, lora_raw=raw)

    def describe(self, args, num_trainable):
        return (f" | LoRA r{args.lora_rank} alpha {args.lora_alpha} on {args.lora_target_modules}: "
                f"{num_trainable / 1e6:.3f}M trainable")


def build_adapter(args, family):
    return (LoraAdapter if args.use_lora else FullModel)(args, family)
