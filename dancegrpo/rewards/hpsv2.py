"""HPS v2.1 reward: open_clip ViT-H-14 with the HPS v2.1 weights; score = cos(image, own prompt).

Upstream (DanceGRPO) builds `hpsv2.src.open_clip.create_model_and_transforms('ViT-H-14',
'./hps_ckpt/open_clip_pytorch_model.bin', precision='amp', light_augmentation=True, ...)`,
loads `HPS_v2.1_compressed.pt['state_dict']` over it (strict), tokenises with
`get_tokenizer('ViT-H-14')` and scores diag(image_features @ text_features.T) with both
features L2-normalised, i.e. the cosine of each image with its own prompt.

This module uses the maintained `open-clip-torch` package instead of the `hpsv2` wheel
(which lacks its BPE vocabulary file, imports the dead `clint` package and pins
pytest==7.2.0 / protobuf==3.20.3). Checked on a tiny config: the two packages' CLIP
models have identical state-dict keys and shapes, a state dict from one loads strictly
into the other and gives bit-identical features, and the tokenisers give identical ids.
Because the HPS state dict loads strictly, it holds EVERY weight of the model, so the
LAION base `open_clip_pytorch_model.bin` that upstream loads first is fully overwritten:
it is not read here (it may stay in the folder). Images are preprocessed exactly like
hpsv2's `preprocess_val` (light augmentation) on the uint8 PIL image, as upstream: longest
side resized to 224 by PIL bicubic -> zero pad to a square -> RGB -> [0, 1] -> OpenAI
mean/std. On GPU the model runs under fp16 autocast (upstream's `torch.amp.autocast('cuda')`).
"""
import os

import torch

from ..errors import MissingFileError
from ._util import as_device, check_pairs, cosine_pairs, option, require_file, reward_autocast

HPS_FILE = "HPS_v2.1_compressed.pt"
HPS_HOW_TO_GET = (f"Download it with `hf download xswu/HPSv2 {HPS_FILE} --local-dir ./hps_ckpt` "
                  "(https://huggingface.co/xswu/HPSv2) and pass the folder as --hps_ckpt_dir.")
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def _open_clip():
    try:
        import open_clip
    except ImportError:
        raise ImportError("The hpsv2 reward needs open-clip-torch: `pip install -r requirements.txt` "
                          "(open-clip-torch==3.3.0).") from None
    return open_clip


def resolve_arch(arch):
    """An open_clip model name ('ViT-H-14') or a path to an open_clip model-config JSON (tests, variants)."""
    open_clip = _open_clip()
    if arch.endswith(".json"):
        if not os.path.isfile(arch):
            raise MissingFileError(f"--hps_arch {arch!r}: no such open_clip config file")
        open_clip.add_model_config(arch)  # registered under the file's stem
        return os.path.splitext(os.path.basename(arch))[0]
    if arch not in open_clip.list_models():
        raise ValueError(f"--hps_arch {arch!r} is not an open_clip model name (HPS v2.1 uses ViT-H-14) "
                         "nor a .json model config")
    return arch


def load_hps_state_dict(path):
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        if isinstance(e, FileNotFoundError):
            raise
        # Older checkpoints may pickle more than tensors; this file is the user's own download.
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    state = ckpt.get("state_dict", ckpt) if isinstance(ckpt, dict) else None
    if not isinstance(state, dict) or not state:
        raise ValueError(f"{path!r} holds no state dict (expected {{'state_dict': ...}} as in {HPS_FILE}). "
                         + HPS_HOW_TO_GET)
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}


def load_hps_model(ckpt_dir, arch="ViT-H-14", device="cpu"):
    """Return (open_clip model in eval mode on `device`, tokenizer) loaded from `ckpt_dir`/HPS_v2.1_compressed.pt."""
    path = require_file(os.path.join(ckpt_dir, HPS_FILE), "HPS v2.1 reward", HPS_HOW_TO_GET)
    open_clip = _open_clip()
    name = resolve_arch(arch)
    state = load_hps_state_dict(path)
    model = open_clip.create_model(name, pretrained=None, precision="fp32", device=device)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise RuntimeError(f"{path!r} does not match the open_clip architecture {name!r} (--hps_arch): "
                           f"{str(e)[:500]}") from None
    return model.eval().requires_grad_(False), open_clip.get_tokenizer(name)


def _image_size(model):
    size = getattr(model.visual, "image_size", 224)
    if isinstance(size, (tuple, list)):
        if size[0] != size[1]:
            raise ValueError(f"Non-square image size {size} is not supported")
        size = size[0]
    return int(size)


def preprocess(images, size, mean=OPENAI_MEAN, std=OPENAI_STD, device="cpu"):
    """hpsv2's `preprocess_val` (light augmentation) on each PIL image, as upstream calls it on the
    uint8 image: longest side resized to `size` by PIL's bicubic (output rounded to uint8), zero
    padded to a square, then [0, 1] and mean/std. Returns [N, 3, size, size] float32."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F
    out = []
    for im in images:
        w, h = im.size
        scale = size / float(max(h, w))
        if scale != 1.0:
            nh, nw = round(h * scale), round(w * scale)
            im = F.resize(im, [nh, nw], interpolation=InterpolationMode.BICUBIC)
            ph, pw = size - nh, size - nw
            im = F.pad(im, [pw // 2, ph // 2, pw - pw // 2, ph - ph // 2], fill=0)
        out.append(F.pil_to_tensor(im.convert("RGB")))
    x = torch.stack(out).to(device).float().div(255)
    m = torch.tensor(mean, device=device).view(1, 3, 1, 1)
    s = torch.tensor(std, device=device).view(1, 3, 1, 1)
    return (x - m) / s


class HPSv2Reward:
    def __init__(self, model, tokenizer, device):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.size = _image_size(model)
        self.mean = tuple(getattr(model.visual, "image_mean", None) or OPENAI_MEAN)
        self.std = tuple(getattr(model.visual, "image_std", None) or OPENAI_STD)

    @torch.no_grad()
    def __call__(self, images, prompts):
        check_pairs(images, prompts)
        pixels = preprocess(images, self.size, self.mean, self.std, self.device)
        tokens = self.tokenizer(list(prompts)).to(self.device)
        with reward_autocast(self.device, torch.float16):
            image_features = self.model.encode_image(pixels)
            text_features = self.model.encode_text(tokens)
        return cosine_pairs(image_features, text_features).cpu()


def build(device=None, options=None):
    device = as_device(device)
    model, tokenizer = load_hps_model(option(options, "hps_ckpt_dir", "./hps_ckpt"),
                                      option(options, "hps_arch", "ViT-H-14"), device)
    return HPSv2Reward(model, tokenizer, device)
