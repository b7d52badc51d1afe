# A stand-in for Flow-GRPO's config/base.py (ml_collections): the fields scripts/train_sd3.py reads,
# with the recipe's structure; sizes for CPU tests in config/grpo.py.
import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.run_name = ""
    config.seed = 42
    config.logdir = "logs"
    config.save_dir = "logs/run"
    config.mixed_precision = "fp16"
    config.use_lora = True
    config.resolution = 512
    config.save_freq = 20
    config.eval_freq = 20
    config.reward_fn = ml_collections.ConfigDict({"jpeg_compressibility": 1.0})
    config.prompt_fn = "general_ocr"
    config.dataset = "dataset/tiny"
    config.per_prompt_stat_tracking = True

    config.pretrained = pretrained = ml_collections.ConfigDict()
    pretrained.model = "tiny"
    pretrained.dtype = "float16"

    config.sample = sample = ml_collections.ConfigDict()
    sample.num_steps = 10
    sample.eval_num_steps = 10
    sample.guidance_scale = 4.5
    sample.noise_level = 0.7
    sample.train_batch_size = 9
    sample.test_batch_size = 2
    sample.num_image_per_prompt = 24
    sample.num_batches_per_epoch = 4
    sample.global_std = False

    config.train = train = ml_collections.ConfigDict()
    train.batch_size = sample.train_batch_size
    train.learning_rate = 3e-4
    train.adam_beta1 = 0.9
    train.adam_beta2 = 0.999
    train.adam_weight_decay = 1e-4
    train.adam_epsilon = 1e-8
    train.gradient_accumulation_steps = sample.num_batches_per_epoch // 2
    train.max_grad_norm = 1.0
    train.num_inner_epochs = 1
    train.cfg = True
    train.adv_clip_max = 5
    train.clip_range = 1e-4
    train.timestep_fraction = 0.99
    train.beta = 0.04
    train.ema = True
    return config
