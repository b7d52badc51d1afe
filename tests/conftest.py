"""Session fixtures: tiny reward models written to disk once per test session."""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_models import TINY_OPEN_CLIP, build_tiny_hf_clip  # noqa: E402


@pytest.fixture(scope="session")
def tiny_hps(tmp_path_factory):
    """(ckpt_dir holding HPS_v2.1_compressed.pt, path of the open_clip config JSON)."""
    import open_clip
    root = tmp_path_factory.mktemp("hps")
    config = root / "tiny-hps-clip.json"
    config.write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(str(config))
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-hps-clip", pretrained=None)
    ckpt = root / "hps_ckpt"
    ckpt.mkdir()
    torch.save({"state_dict": model.state_dict()}, ckpt / "HPS_v2.1_compressed.pt")
    return str(ckpt), str(config)


@pytest.fixture(scope="session")
def tiny_hf_clip(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfclip")
    return build_tiny_hf_clip(str(root), with_processor_in_model=True)
