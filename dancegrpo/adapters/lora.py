"""LoRA adapters (peft) on the transformer, as upstream's train_grpo_flux_lora.py trains them.

`--use_lora` freezes the base weights and adds one adapter ("default", peft's LoraConfig with
`--lora_rank`, `--lora_alpha`, `--lora_target_modules`, B initialised to zero, so step 0 is
the base model). Only the adapter's parameters require grad, so only they reach the optimizer,
the gradient clipping and the EMA; the trainer and the JAGG seam see no difference (they call
the model and read `requires_grad` parameters).

Checkpoints hold the adapter in diffusers' LoRA format, `pytorch_lora_weights.safetensors` with
keys `transformer.<module>.lora_A.weight` / `lora_B.weight` and the LoraConfig as metadata (so
the alpha survives: diffusers otherwise assumes alpha = rank) and the record of the model it was
trained on (dancegrpo.adapters.origin: checked wherever an adapter is loaded), which
`FluxPipeline.load_lora_weights(dir)` / `QwenImagePipeline.load_lora_weights(dir)` read; with
`--lora_save_merged` also `merged/`, a full transformer folder with W + (alpha / r) B A.
"""
import json
import os

import torch
from safetensors.torch import load_file, save_file

from ..utils.checkpoint import LORA_WEIGHTS_NAME, write_transformer_folder
from ..errors import ConfigError
from .flags import target_modules
from .origin import ORIGIN_KEY, PREFIX, AdapterMismatch, check_adapter, origin_record

ADAPTER = "default"


def lora_config(args):
    from peft import LoraConfig
    return LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, init_lora_weights=True,
                      target_modules=target_modules(args))


def add_lora(transformer, args, seed):
    """Freeze the base, add the adapter (A drawn from `seed`, the same on every rank and in any
    reference built the same way; B = 0); returns the number of adapter parameters."""
    transformer.requires_grad_(False)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            transformer.add_adapter(lora_config(args))
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ConfigError(f"--lora_target_modules {args.lora_target_modules!r}: {e}") from None
    return sum(p.numel() for p in transformer.parameters() if p.requires_grad)


def is_adapter_key(name):
    return ".lora_A." in name or ".lora_B." in name


def adapter_state(state):
    """The model's (prefix-free) state dict -> the adapter in diffusers' LoRA key format."""
    return {PREFIX + k.replace(f".{ADAPTER}.", "."): v for k, v in state.items() if is_adapter_key(k)}


def merged_state(state, scale):
    """Full state dict of the adapted model -> the plain model's, with W + scale * B @ A."""
    merged = {}
    for key, value in state.items():
        if is_adapter_key(key):
            continue
        merged[key.replace(".base_layer.", ".")] = value
    for key in state:
        if key.endswith(f".lora_A.{ADAPTER}.weight"):
            module = key[:-len(f".lora_A.{ADAPTER}.weight")]
            a, b = state[key], state[f"{module}.lora_B.{ADAPTER}.weight"]
            w = merged[f"{module}.weight"]
            merged[f"{module}.weight"] = (w.double() + scale * (b.double() @ a.double())).to(w.dtype)
    return merged


class LoraWeights:
    """The checkpoint weights of a LoRA run (trainer.save / checkpoint.save_checkpoint call it)."""

    def __init__(self, args, pipeline_class_name):
        self.config = lora_config(args)
        self.scale = args.lora_alpha / args.lora_rank
        self.pipeline_class_name = pipeline_class_name
        self.save_merged = args.lora_save_merged

    @property
    def trainable_only(self):
        """Gather only the adapter unless merged weights are written (the base is then needed)."""
        return not self.save_merged

    def write(self, folder, state, model_config):
        import diffusers
        pipeline = getattr(diffusers, self.pipeline_class_name)
        pipeline.save_lora_weights(folder, transformer_lora_layers={k[len(PREFIX):]: v for k, v in
                                                                    adapter_state(state).items()},
                                   save_function=self._save_function(pipeline, model_config))
        if self.save_merged:
            write_transformer_folder(os.path.join(folder, "merged"), merged_state(state, self.scale), model_config)

    def _save_function(self, pipeline, model_config):
        """diffusers' safetensors writer, with the LoraConfig metadata as it writes it (keys under the
        transformer's prefix, so the alpha survives), plus the record of the model the adapter belongs
        to (dancegrpo.adapters.origin). A writer of its own, because diffusers' takes no extra metadata."""
        from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
        config = json.loads(json.dumps(self.config.to_dict(), default=sorted))   # sets -> lists
        packed = {f"{pipeline.transformer_name}.{k}": v for k, v in config.items()}
        metadata = {"format": "pt", LORA_ADAPTER_METADATA_KEY: json.dumps(packed, indent=2, sort_keys=True),
                    ORIGIN_KEY: json.dumps(origin_record(model_config), sort_keys=True)}
        return lambda weights, filename: save_file(weights, filename, metadata=metadata)

    @staticmethod
    def read_state(folder):
        """A checkpoint's (or its ema/'s) adapter, keyed as this model's parameters."""
        path = os.path.join(folder, LORA_WEIGHTS_NAME)
        if not os.path.isfile(path):
            raise ConfigError(f"{folder!r} holds no {LORA_WEIGHTS_NAME}: with --use_lora, resume from a LoRA "
                              "checkpoint (a full-weights folder goes to --pretrained_model_name_or_path)")
        saved = {k[len(PREFIX):] if k.startswith(PREFIX) else k: v for k, v in load_file(path).items()}
        return {k.replace(".lora_A.", f".lora_A.{ADAPTER}.").replace(".lora_B.", f".lora_B.{ADAPTER}."): v
                for k, v in saved.items()}

    def load_into(self, raw_model, folder):
        """Load a checkpoint's adapter into a model that already has it (before FSDP)."""
        state = self.read_state(folder)
        try:
            check_adapter(os.path.join(folder, LORA_WEIGHTS_NAME), raw_model)
        except AdapterMismatch as e:
            raise ConfigError(str(e)) from None
        params = {k: p for k, p in raw_model.named_parameters() if is_adapter_key(k)}
        if set(state) != set(params):
            extra, missing = sorted(set(state) - set(params)), sorted(set(params) - set(state))
            raise ConfigError(f"the adapter in {folder!r} does not match this run's (--lora_target_modules?): "
                              f"missing {missing[:3]}, unexpected {extra[:3]}")
        with torch.no_grad():
            for k, v in state.items():
                if params[k].shape != v.shape:
                    raise ConfigError(f"the adapter in {folder!r} has {k} of shape {tuple(v.shape)}, this run "
                                      f"{tuple(params[k].shape)} (--lora_rank differs?)")
                params[k].copy_(v)
