"""Rewards that need no weights, for the offline presets and tests (torch imported as they score:
this module is registered where the command line is built)."""
import io

from . import register_reward


def jpeg_kilobytes(image, quality=95):
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


@register_reward("jpeg")
def build_jpeg_compressibility(device=None, options=None):
    """DDPO's compressibility reward: minus the JPEG size (kB, quality 95)."""
    def reward(images, prompts):
        import torch
        return torch.tensor([-jpeg_kilobytes(im) for im in images], dtype=torch.float32)
    return reward


@register_reward("jpeg_incompressibility")
def build_jpeg_incompressibility(device=None, options=None):
    """DDPO's incompressibility reward: plus the JPEG size (kB)."""
    def reward(images, prompts):
        import torch
        return torch.tensor([jpeg_kilobytes(im) for im in images], dtype=torch.float32)
    return reward
