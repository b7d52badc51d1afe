"""PickScore reward: logit_scale.exp() * cos(image, own prompt) with transformers CLIP.

Upstream (DanceGRPO) used the processor of laion/CLIP-ViT-H-14-laion2B-s32B-b79K and the
model yuvalkirstain/PickScore_v1, but scored every image against the FIRST caption of
the batch and left out logit_scale. Here each image is scored against its own prompt and
the score is the PickScore paper's `model.logit_scale.exp() * (text_emb . image_emb)`
(about 100 x cosine for PickScore_v1; typical values ~ 18-24). Both folders are local.
"""
from ._util import as_device, option
from .hf_clip import CLIPPairScorer, load_clip

PROCESSOR_HOW = ("Download the processor with `hf download laion/CLIP-ViT-H-14-laion2B-s32B-b79K --include '*.json' "
                 "'*.txt' --local-dir ./pickscore_ckpt/processor` and pass --pickscore_processor_path.")
MODEL_HOW = ("Download the model with `hf download yuvalkirstain/PickScore_v1 --local-dir ./pickscore_ckpt/model` "
             "and pass --pickscore_model_path.")


class PickScoreReward(CLIPPairScorer):
    def __call__(self, images, prompts):
        cos = self.cosine(images, prompts)
        return (self.model.logit_scale.detach().float().exp() * cos).cpu()


def build(device=None, options=None):
    device = as_device(device)
    processor, model = load_clip(option(options, "pickscore_model_path", "./pickscore_ckpt/model"),
                                 option(options, "pickscore_processor_path", "./pickscore_ckpt/processor"),
                                 device, "--pickscore_model_path", "--pickscore_processor_path",
                                 MODEL_HOW, PROCESSOR_HOW)
    return PickScoreReward(processor, model, device)
