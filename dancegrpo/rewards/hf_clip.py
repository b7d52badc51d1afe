"""transformers CLIP (processor + model from local folders), shared by pickscore and clipscore."""
import json
import os

import torch

from ..errors import MissingFileError
from ._util import check_pairs, reward_autocast

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _check_model_folder(path, flag, how_to_get):
    if not path or not os.path.isdir(path):
        raise MissingFileError(f"{flag} {path!r} is not a folder. {how_to_get}")
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise MissingFileError(f"{flag} {path!r} lacks config.json (not a transformers model folder). {how_to_get}")
    if not any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES):
        raise MissingFileError(f"{flag} {path!r} lacks the weights (one of {', '.join(WEIGHT_FILES)}). {how_to_get}")
    with open(config) as f:
        model_type = json.load(f).get("model_type")
    if model_type != "clip":
        raise ValueError(f"{flag} {path!r} holds a {model_type!r} model, not a CLIP model. {how_to_get}")


def _check_processor_folder(path, flag, how_to_get):
    if not path or not os.path.isdir(path):
        raise MissingFileError(f"{flag} {path!r} is not a folder. {how_to_get}")
    if not any(os.path.isfile(os.path.join(path, f)) for f in PROCESSOR_FILES):
        raise MissingFileError(f"{flag} {path!r} lacks {' or '.join(PROCESSOR_FILES)} (not a CLIP processor "
                                f"folder). {how_to_get}")
    if not (os.path.isfile(os.path.join(path, "tokenizer.json"))
            or os.path.isfile(os.path.join(path, "vocab.json"))):
        raise MissingFileError(f"{flag} {path!r} lacks the tokenizer (tokenizer.json or vocab.json + merges.txt). "
                                f"{how_to_get}")


def load_clip(model_path, processor_path, device, model_flag, processor_flag, model_how, processor_how):
    """(processor, CLIPModel fp32 eval on device) from local folders; no network access."""
    from transformers import AutoProcessor, CLIPModel
    _check_processor_folder(processor_path, processor_flag, processor_how)
    _check_model_folder(model_path, model_flag, model_how)
    processor = AutoProcessor.from_pretrained(processor_path, local_files_only=True)
    model = CLIPModel.from_pretrained(model_path, local_files_only=True, torch_dtype=torch.float32)
    return processor, model.to(device).eval().requires_grad_(False)


def _features(out):
    """transformers 4.x returns the projected features; 5.x a ModelOutput whose pooler_output holds them."""
    return out if torch.is_tensor(out) else out.pooler_output


class CLIPPairScorer:
    """Cosine of each image with its OWN prompt, one batched forward per call.

    In float32 on every device: upstream scores PickScore in fp32 (no autocast)."""
    autocast_dtype = None

    def __init__(self, processor, model, device):
        self.processor, self.model, self.device = processor, model, device
        self.max_length = getattr(model.config.text_config, "max_position_embeddings", 77)

    @torch.no_grad()
    def cosine(self, images, prompts):
        check_pairs(images, prompts)
        pixels = self.processor(images=[im.convert("RGB") for im in images], return_tensors="pt")["pixel_values"]
        text = self.processor(text=list(prompts), padding=True, truncation=True, max_length=self.max_length,
                              return_tensors="pt")
        with reward_autocast(self.device, self.autocast_dtype):
            image_features = _features(self.model.get_image_features(pixel_values=pixels.to(self.device)))
            text_features = _features(self.model.get_text_features(
                input_ids=text["input_ids"].to(self.device), attention_mask=text["attention_mask"].to(self.device)))
        img = torch.nn.functional.normalize(image_features.float(), dim=-1)
        txt = torch.nn.functional.normalize(text_features.float(), dim=-1)
        return (img * txt).sum(dim=-1)
