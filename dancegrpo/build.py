"""Setup of a training run: models, adapters, engine, EMA, data, reward and the KL reference,
gathered in the TrainContext the loop reads; and the banner that describes it."""
import os
from dataclasses import dataclass, field

import torch

from .adapters import build_adapter
from .algo.grpo import num_train_timesteps
from .algo.ratio_stats import RatioMeter
from .algo.sde import model_timesteps, sigma_schedule
from .digits.data import digit_of_prompt
from .engines import build_engine
from .rewards import WeightedReward
from .run.resume import tool_plan
from .run.run_config import config_id, snapshot
from .samples import grid_rows
from .utils import checkpoint as ckpt
from .utils.activation_meter import ActivationMeter
from .utils.communications import init_distributed
from .utils.data import PromptEmbeddingDataset, infinite_prompt_batches
from .utils.ema import ParamEMA
from .utils.metrics import PassCounter
from .utils.precision import compute_autocast, describe_precision
from .utils.state_bytes import describe_bytes, per_rank_bytes


def record_labels(args, seed, world_size, device):
    """{precision, config_id} of the run (TrainContext.record_labels)."""
    return {"precision": describe_precision(device, args.mixed_precision),
            "config_id": config_id(snapshot(args, seed, world_size))}


@dataclass
class TrainContext:
    """Everything a training step needs; built once by `setup`."""
    args: object
    family: object
    transformer: torch.nn.Module      # what the loop calls: engine.model (FSDP-wrapped, a DeepSpeed engine...)
    raw_transformer: torch.nn.Module  # the diffusers model inside
    vae: torch.nn.Module
    reward_fn: object
    loader: object
    device: torch.device
    counter: PassCounter
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    ema: object = None
    engine: object = None             # a dancegrpo.engines.Engine: the loop's only way to step
    step: int = 0
    activation_meter: ActivationMeter = field(default_factory=ActivationMeter)
    ratio_meter: RatioMeter = field(default_factory=RatioMeter)   # the step's PPO ratio statistics
    resumed_update_state: object = None   # what the resumed checkpoint saved of the policy update
    resumed_from: str = None          # the checkpoint folder the run resumed from
    saved_since_resume: bool = False  # a checkpoint of this run is whole: the one resumed from may go
    dataset: object = None            # the prompt-embedding dataset (the sample grids' prompts)
    num_params: int = 0               # the transformer's parameters, and those trained
    num_trainable: int = 0
    adapter: object = None            # what is trained (dancegrpo.adapters): weights format, reference, banner
    reference: object = None          # the frozen reference policy of the KL term (--kl_beta > 0)
    # What every step record says the run is: its precision and config_id (equal over a resumed run's
    # segments unless --allow_config_change changed a flag), for the tools that compare runs.
    record_labels: dict = field(default_factory=dict)
    sample_rows: list = None          # the dataset rows of the sample grids (one per digit in the digits world)

    # The engine owns the optimizer and its schedule; these are its, never copies.
    @property
    def optimizer(self):
        return self.engine.optimizer

    @property
    def lr_scheduler(self):
        return self.engine.lr_scheduler


def setup(args, family, plan=None):
    """Load models, data and reward; wrap for distributed; restore the planned checkpoint
    (`plan_run`'s; a tool without a run folder passes none)."""
    rank, world_size, _, device = init_distributed()
    plan = plan or tool_plan(args)
    if args.allow_tf32 and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    seed, resume = plan["seed"], plan["resume"]
    torch.manual_seed(seed + rank)

    dataset = PromptEmbeddingDataset(args.data_json_path, family.embedding_fields)
    reward_fn = WeightedReward(args.reward_terms, device, args)
    raw, vae = family.load(args, device)
    adapter = build_adapter(args, family)
    adapter.attach(raw, args, seed)   # before any wrapping
    weights_format = adapter.weights_format
    if resume:
        weights_format.load_into(raw, resume)
    num_params = sum(p.numel() for p in raw.parameters())  # before FSDP shards them
    num_trainable = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    engine = build_engine(args, family, raw, device, world_size)
    model = engine.model
    ema = ParamEMA(engine.ema_module, args.ema_decay) if args.use_ema else None

    start_step, state = 0, None
    if resume:
        state = ckpt.load_training_state(resume, engine)
        start_step = state["step"] if state else 0
        if ema is not None and os.path.isdir(os.path.join(resume, "ema")):
            ema.load_full_state(engine.ema_module, weights_format.read_state(os.path.join(resume, "ema")))

    sigmas = sigma_schedule(args.sampling_steps, args.shift)
    loader = infinite_prompt_batches(dataset, args.train_batch_size, rank, world_size,
                                     args.sampler_seed if args.sampler_seed is not None else seed,
                                     args.dataloader_num_workers, start_batch=start_step)
    ctx = TrainContext(args=args, family=family, transformer=model, raw_transformer=raw, vae=vae,
                       reward_fn=reward_fn, loader=loader,
                       device=device, counter=PassCounter(raw), sigmas=sigmas, timesteps=model_timesteps(sigmas),
                       rank=rank, world_size=world_size, seed=seed, ema=ema, engine=engine, step=start_step,
                       resumed_update_state=(state or {}).get("policy_update"), resumed_from=resume,
                       dataset=dataset, num_params=num_params, num_trainable=num_trainable, adapter=adapter,
                       record_labels=record_labels(args, seed, world_size, device),
                       sample_rows=grid_rows([item["caption"] for item in dataset.items], digit_of_prompt))
    if args.kl_beta > 0:
        def run(module, latents, timesteps, cond):
            with compute_autocast(device, args.mixed_precision):
                return family.predict(module, latents, timesteps, cond)
        ctx.reference = adapter.reference(run, model, raw, device)
    return ctx


def describe(ctx):
    args = ctx.args
    n_params = ctx.num_params
    samples = args.train_batch_size * (args.num_generations if args.use_group else 1)
    # Under --sde_window_size each sample trains its window, whatever the fraction.
    n_train = args.sde_window_size or num_train_timesteps(args.sampling_steps - 1, args.timestep_fraction)
    adapter = ctx.adapter.describe(args, ctx.num_trainable)
    return (f"{ctx.family.name}: {n_params / 1e6:.2f}M params | {ctx.world_size} rank(s){ctx.engine.label()} on "
            f"{ctx.device}{adapter} | computes in {describe_precision(ctx.device, args.mixed_precision)} | "
            f"{samples} samples/rank/step, S={args.sampling_steps}, {n_train} trained transitions/sample, "
            f"GA={args.gradient_accumulation_steps} | seed {ctx.seed}"
            + (f" | resumed from {ctx.resumed_from} at step {ctx.step}" if ctx.resumed_from else "")
            + "\ntraining state: " + describe_bytes(per_rank_bytes(
                ctx.engine.state_setup(ctx.adapter), n_params, ctx.num_trainable, ctx.world_size,
                ctx.engine.weight_type)))
