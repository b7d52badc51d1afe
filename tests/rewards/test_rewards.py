"""hpsv2 / pickscore / clipscore: tiny models saved to disk, loaded back through the real loaders,
checked against an independent computation of each formula."""
import argparse
import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from dancegrpo.rewards import RewardNotFiniteError, WeightedReward, add_reward_args
from tiny_models import options, random_images

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
SIZES = [(64, 64), (64, 64), (96, 48), (40, 72)]  # square and non-square (padding path)
PROMPTS = ["a red cat on a mat", "an astronaut riding a horse", "a bowl of soup", "two dogs playing in snow"]


# ---------------------------------------------------------------- hpsv2
def _hps_reference_matrix(ckpt_dir, config_path, images, prompts):
    """cos(image_i, prompt_j) computed directly with the open_clip model, one image at a time."""
    import open_clip
    name = os.path.splitext(os.path.basename(config_path))[0]
    model = open_clip.create_model(name, pretrained=None)
    model.load_state_dict(torch.load(os.path.join(ckpt_dir, "HPS_v2.1_compressed.pt"))["state_dict"])
    model.eval()
    pix = []
    for im in images:  # hpsv2's preprocess_val(light_augmentation=True) on the PIL image, in plain PIL
        w, h = im.size
        s = 224 / max(h, w)
        if s != 1.0:
            nh, nw = round(h * s), round(w * s)
            canvas = Image.new("RGB", (224, 224), (0, 0, 0))
            canvas.paste(im.convert("RGB").resize((nw, nh), Image.BICUBIC), ((224 - nw) // 2, (224 - nh) // 2))
            im = canvas
        x = torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1)
        pix.append((x - torch.tensor(OPENAI_MEAN).view(3, 1, 1)) / torch.tensor(OPENAI_STD).view(3, 1, 1))
    with torch.no_grad():
        img = model.encode_image(torch.stack(pix), normalize=True)
        txt = model.encode_text(open_clip.get_tokenizer(name)(prompts), normalize=True)
    return img @ txt.T


def test_hpsv2_matches_independent_formula_and_pairs_prompts(tiny_hps):
    from dancegrpo.rewards.hpsv2 import build
    ckpt, config = tiny_hps
    images = random_images(SIZES)
    reward = build("cpu", options(hps_ckpt_dir=ckpt, hps_arch=config))
    scores = reward(images, PROMPTS)
    ref = _hps_reference_matrix(ckpt, config, images, PROMPTS)
    assert scores.shape == (4,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    torch.testing.assert_close(scores, ref.diagonal(), atol=1e-5, rtol=0)
    perm = [2, 0, 3, 1]
    swapped = reward(images, [PROMPTS[p] for p in perm])
    torch.testing.assert_close(swapped, ref[torch.arange(4), perm], atol=1e-5, rtol=0)
    assert (swapped - scores).abs().max() > 1e-4


def test_hpsv2_one_forward_per_batch(tiny_hps):
    from dancegrpo.rewards.hpsv2 import build
    ckpt, config = tiny_hps
    reward = build("cpu", options(hps_ckpt_dir=ckpt, hps_arch=config))
    calls = []
    reward.model.visual.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    reward(random_images(SIZES), PROMPTS)
    assert calls == [4]


def test_hpsv2_missing_file_and_wrong_arch(tiny_hps, tmp_path):
    from dancegrpo.rewards.hpsv2 import build
    ckpt, config = tiny_hps
    with pytest.raises(FileNotFoundError, match=r"HPS_v2\.1_compressed\.pt.*hf download xswu/HPSv2"):
        build("cpu", options(hps_ckpt_dir=str(tmp_path), hps_arch=config))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build("cpu", options(hps_ckpt_dir=str(tmp_path / "nope"), hps_arch=config))
    other = tmp_path / "other.json"
    cfg = json.load(open(config))
    cfg["embed_dim"] = 16
    other.write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError, match="does not match the open_clip architecture"):
        build("cpu", options(hps_ckpt_dir=ckpt, hps_arch=str(other)))
    with pytest.raises(ValueError, match="not an open_clip model name"):
        build("cpu", options(hps_ckpt_dir=ckpt, hps_arch="ViT-Nope"))


def test_nan_reward_stops_before_update(tiny_hps, tmp_path):
    ckpt, config = tiny_hps
    state = torch.load(os.path.join(ckpt, "HPS_v2.1_compressed.pt"))
    state["state_dict"]["visual.proj"] = torch.full_like(state["state_dict"]["visual.proj"], float("nan"))
    torch.save(state, tmp_path / "HPS_v2.1_compressed.pt")
    reward = WeightedReward([("hpsv2", 1.0)], "cpu", options(hps_ckpt_dir=str(tmp_path), hps_arch=config))
    with pytest.raises(RewardNotFiniteError, match="hpsv2.*before the policy update"):
        reward(random_images(SIZES[:2]), PROMPTS[:2])


# ---------------------------------------------------------------- transformers CLIP (pickscore, clipscore)
def _hf_reference_cos(proc_dir, model_dir, images, prompts):
    """cos(image_i, prompt_j) from the model's towers and projections directly, one image at a time."""
    from transformers import CLIPModel, CLIPProcessor
    proc = CLIPProcessor.from_pretrained(proc_dir)
    model = CLIPModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        img = torch.cat([model.visual_projection(model.vision_model(
            pixel_values=proc(images=[im], return_tensors="pt")["pixel_values"]).pooler_output) for im in images])
        tok = proc(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        txt = model.text_projection(model.text_model(input_ids=tok["input_ids"],
                                                     attention_mask=tok["attention_mask"]).pooler_output)
    img = img / img.norm(dim=-1, keepdim=True)
    txt = txt / txt.norm(dim=-1, keepdim=True)
    return img @ txt.T, model.logit_scale.exp().item()


def test_pickscore_matches_independent_formula_and_pairs_prompts(tiny_hf_clip):
    from dancegrpo.rewards.pickscore import build
    proc_dir, model_dir = tiny_hf_clip
    images = random_images(SIZES, seed=1)
    reward = build("cpu", options(pickscore_processor_path=proc_dir, pickscore_model_path=model_dir))
    scores = reward(images, PROMPTS)
    cos, scale = _hf_reference_cos(proc_dir, model_dir, images, PROMPTS)
    assert abs(scale - 10.0) < 0.1  # logit_scale_init_value=2.3 -> exp ~ 9.97: the scale is applied
    assert scores.shape == (4,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    torch.testing.assert_close(scores, scale * cos.diagonal(), atol=1e-5, rtol=0)
    perm = [3, 2, 1, 0]
    swapped = reward(images, [PROMPTS[p] for p in perm])
    torch.testing.assert_close(swapped, scale * cos[torch.arange(4), perm], atol=1e-5, rtol=0)
    assert (swapped - scores).abs().max() > 1e-4


def test_clipscore_matches_independent_formula_and_pairs_prompts(tiny_hf_clip):
    from dancegrpo.rewards.clipscore import build
    proc_dir, model_dir = tiny_hf_clip  # the model folder holds its processor too
    images = random_images(SIZES, seed=2)
    reward = build("cpu", options(clipscore_model_path=model_dir))
    scores = reward(images, PROMPTS)
    cos, _ = _hf_reference_cos(proc_dir, model_dir, images, PROMPTS)
    assert scores.shape == (4,) and torch.isfinite(scores).all()
    torch.testing.assert_close(scores, 100 * cos.diagonal().clamp(min=0), atol=1e-5, rtol=0)
    for perm in ([1, 0, 3, 2], [3, 2, 1, 0], [1, 2, 3, 0]):
        swapped = reward(images, [PROMPTS[p] for p in perm])
        torch.testing.assert_close(swapped, 100 * cos[torch.arange(4), perm].clamp(min=0), atol=1e-5, rtol=0)


def test_hf_clip_one_forward_per_batch(tiny_hf_clip):
    from dancegrpo.rewards.pickscore import build
    proc_dir, model_dir = tiny_hf_clip
    reward = build("cpu", options(pickscore_processor_path=proc_dir, pickscore_model_path=model_dir))
    calls = []
    reward.model.vision_model.register_forward_hook(lambda m, i, o: calls.append(1))
    reward.model.text_model.register_forward_hook(lambda m, i, o: calls.append(2))
    reward(random_images(SIZES), PROMPTS)
    assert calls == [1, 2]


def test_hf_clip_missing_and_wrong_folders(tiny_hf_clip, tmp_path):
    from dancegrpo.rewards.clipscore import build as build_clip
    from dancegrpo.rewards.pickscore import build as build_pick
    proc_dir, model_dir = tiny_hf_clip
    with pytest.raises(FileNotFoundError, match="--pickscore_model_path.*lacks config.json.*PickScore_v1"):
        build_pick("cpu", options(pickscore_processor_path=proc_dir, pickscore_model_path=proc_dir))
    with pytest.raises(FileNotFoundError, match="--pickscore_processor_path.*not a folder.*CLIP-ViT-H-14"):
        build_pick("cpu", options(pickscore_processor_path=str(tmp_path / "nope"), pickscore_model_path=model_dir))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(model_dir, "config.json"), no_weights)
    with pytest.raises(FileNotFoundError, match="lacks the weights"):
        build_clip("cpu", options(clipscore_model_path=str(no_weights), clipscore_processor_path=proc_dir))
    not_clip = tmp_path / "not_clip"
    shutil.copytree(model_dir, not_clip)
    cfg = json.load(open(not_clip / "config.json"))
    cfg["model_type"] = "siglip"
    json.dump(cfg, open(not_clip / "config.json", "w"))
    with pytest.raises(ValueError, match="not a CLIP model"):
        build_clip("cpu", options(clipscore_model_path=str(not_clip)))
    with pytest.raises(FileNotFoundError, match="processor"):
        build_clip("cpu", options(clipscore_model_path=model_dir, clipscore_processor_path=str(no_weights)))


def test_reward_flags_default_and_reach_factories(tiny_hf_clip):
    p = argparse.ArgumentParser()
    add_reward_args(p)
    args = p.parse_args([])
    assert args.hps_ckpt_dir == "./hps_ckpt" and args.hps_arch == "ViT-H-14"
    assert args.pickscore_model_path and args.pickscore_processor_path and args.clipscore_model_path
    proc_dir, model_dir = tiny_hf_clip
    args = p.parse_args(["--clipscore_model_path", model_dir])
    reward = WeightedReward([("clipscore", 2.0)], "cpu", args)
    out = reward(random_images(SIZES[:2]), PROMPTS[:2])
    torch.testing.assert_close(out, 2.0 * reward.last_terms["clipscore"])


@pytest.mark.parametrize("flags, said", [
    (["--reward", "hpsv2", "--hps_ckpt_dir", "{tmp}/no_hps"], "HPS v2.1 reward: file"),
    (["--reward", "pickscore", "--pickscore_model_path", "{tmp}/no_model", "--pickscore_processor_path",
      "{tmp}/no_processor"], "is not a folder")], ids=["hpsv2", "pickscore"])
def test_a_missing_reward_checkpoint_is_one_line_and_exit_2(cache_dir, tmp_path, capsys, flags, said):
    from helpers import FAST, run_main
    status = run_main("dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir",
                      tmp_path / "run", *FAST, "--max_train_steps", 1, *[f.format(tmp=tmp_path) for f in flags])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and said in err, err
