# A stand-in for upstream DanceGRPO's SD config (ml_collections), with the fields train_grpo_sd.py reads,
# sized for CPU tests; `pretrained.clip_sample` stands for the model folder's scheduler config.
import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.seed = 42
    config.num_epochs = 1
    config.mixed_precision = "no"
    config.use_lora = False
    config.num_generations = 2
    config.pretrained = pretrained = ml_collections.ConfigDict()
    pretrained.clip_sample = False
    pretrained.dtype = "float64"
    config.sample = sample = ml_collections.ConfigDict()
    sample.num_steps = 6
    sample.eta = 1.0
    sample.guidance_scale = 3.0
    sample.batch_size = 2
    config.train = train = ml_collections.ConfigDict()
    train.batch_size = 2
    train.learning_rate = 1e-4
    train.adam_beta1 = 0.9
    train.adam_beta2 = 0.999
    train.adam_weight_decay = 1e-4
    train.adam_epsilon = 1e-8
    train.gradient_accumulation_steps = 2
    train.max_grad_norm = 1e9
    train.num_inner_epochs = 1
    train.cfg = True
    train.adv_clip_max = 5.0
    train.clip_range = 0.2
    train.timestep_fraction = 0.8
    config.prompts = ["a red square", "a blue circle"]
    return config
