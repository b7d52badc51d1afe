"""What differs between upstream's trainers, as the restated train_one_step
(jagg_patch.upstream.step) needs it, one module per trainer, each family a class of the parts of
jagg_patch.upstream.families.base.UpstreamFamily (whose defaults are the image trainers' rules).

A registry: the family name (jagg_patch.upstream.fingerprint.family_of) -> its rules.
"""
from .base import Rollout, UpstreamFamily, repeat_captions, repeat_rows
from .flux import FluxUpstream
from .hunyuan import HunyuanVideoUpstream
from .qwenimage import QwenImageEditUpstream, QwenImageUpstream
from .skyreels import SkyReelsI2VUpstream
from .wan import WanUpstream

FAMILIES = {"flux": FluxUpstream, "qwenimage": QwenImageUpstream, "qwenimage_edit": QwenImageEditUpstream,
            "wan": WanUpstream, "hunyuan": HunyuanVideoUpstream, "skyreels_i2v": SkyReelsI2VUpstream}

__all__ = ["FAMILIES", "Rollout", "UpstreamFamily", "repeat_captions", "repeat_rows"]
