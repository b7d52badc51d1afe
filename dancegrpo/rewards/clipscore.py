"""CLIPScore reward: 100 * max(cos(image, own prompt), 0) with transformers CLIP.

The formula is torchmetrics' CLIPScore (Hessel et al. 2021 use 2.5 * max(cos, 0); divide
by 40 to convert). The processor is read from the model folder unless
--clipscore_processor_path is given. Suggested model: openai/clip-vit-large-patch14.
"""
from ._util import as_device, option
from .hf_clip import CLIPPairScorer, load_clip

HOW = ("Download a CLIP model with `hf download openai/clip-vit-large-patch14 --include '*.json' '*.txt' "
       "model.safetensors --local-dir ./clip_ckpt` "
       "and pass --clipscore_model_path.")
SCALE = 100.0


class CLIPScoreReward(CLIPPairScorer):
    def __call__(self, images, prompts):
        return (SCALE * self.cosine(images, prompts).clamp(min=0)).cpu()


def build(device=None, options=None):
    device = as_device(device)
    model_path = option(options, "clipscore_model_path", "./clip_ckpt")
    processor_path = option(options, "clipscore_processor_path", model_path)
    processor, model = load_clip(model_path, processor_path, device, "--clipscore_model_path",
                                 "--clipscore_processor_path", HOW, HOW)
    return CLIPScoreReward(processor, model, device)
