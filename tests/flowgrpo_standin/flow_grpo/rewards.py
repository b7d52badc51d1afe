# A stand-in for Flow-GRPO's flow_grpo/rewards.py: reward functions by name, each fn(images, prompts,
# metadata) -> (scores, info). jpeg_compressibility is upstream's model-free reward; "smoothness" is this
# stand-in's own (a smooth function of the pixels, so that advantages never tie on tiny images).
import io

import numpy as np
import torch
from PIL import Image


def jpeg_compressibility():
    def _fn(images, prompts, metadata):
        arrays = (images.float().clamp(-1, 1) * 127.5 + 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        sizes = []
        for array in arrays:
            buffer = io.BytesIO()
            Image.fromarray(array).save(buffer, format="JPEG", quality=95)
            sizes.append(buffer.tell() / 1000)
        return -np.array(sizes), {}
    return _fn


def smoothness():
    def _fn(images, prompts, metadata):
        return (-(images.double() - 0.2).pow(2).mean(dim=(1, 2, 3))).numpy(), {}
    return _fn


def multi_score(device, score_dict):
    fns = {name: globals()[name]() for name in score_dict}

    def _fn(images, prompts, metadata):
        scores = {name: fn(images, prompts, metadata)[0] for name, fn in fns.items()}
        scores["avg"] = sum(score_dict[name] * scores[name] for name in fns)
        return scores, {}
    return _fn
