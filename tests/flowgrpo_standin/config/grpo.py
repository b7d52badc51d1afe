# A stand-in for Flow-GRPO's config/grpo.py: named recipes, `--config config/grpo.py:<name>`. Upstream's
# recipes run SD3.5-M at 512 px on 32 GPUs; these keep their schedule (the first int(num_steps *
# timestep_fraction) steps trained, CFG 4.5, the KL term, two optimizer steps per epoch, EMA) on a tiny
# model in float64 on CPU.
import importlib.util
import os


def base_config():
    """config/base.py beside this file, loaded by path (ml_collections loads this file by path too)."""
    spec = importlib.util.spec_from_file_location("base", os.path.join(os.path.dirname(__file__), "base.py"))
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    return base.get_config()


def tiny_sd3():
    config = base_config()
    config.mixed_precision = "no"
    config.pretrained.dtype = "float64"
    config.resolution = 16
    config.sample.num_steps = 6
    config.sample.eval_num_steps = 3
    config.sample.train_batch_size = 2
    config.sample.num_image_per_prompt = 2
    config.sample.num_batches_per_epoch = 4
    config.train.batch_size = 2
    config.train.gradient_accumulation_steps = 2
    config.train.max_grad_norm = 1e9
    config.train.clip_range = 0.2
    config.train.beta = 0.04
    config.reward_fn = {"smoothness": 1.0}
    config.save_freq = 1
    config.eval_freq = 1
    config.dataset = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dataset", "tiny")
    return config


def small_sd3_bench():
    """The benchmark's: Flow-GRPO's 10 steps (9 trained), a larger model, float32, no KL, no evaluation."""
    config = tiny_sd3()
    config.pretrained.model = "small"
    config.pretrained.dtype = "float32"
    config.resolution = 64
    config.sample.num_steps = 10
    config.train.beta = 0.0
    config.eval_freq = 1000
    config.save_freq = 1000
    return config


def get_config(name):
    return globals()[name]()
