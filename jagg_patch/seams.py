"""The ONE list of what jagg_patch touches: in dancegrpo (SEAMS and the fields below), and in an
upstream DanceGRPO checkout's trainer files (UPSTREAM_*, checked by jagg_patch.upstream).

Rebasing onto a new dancegrpo/ is a run of `check_seams` on every trainer: if a
seam moved or its signature changed, it fails here, naming the seam, instead of
silently training vanilla. Rebasing onto a new upstream release is a run of
`python -m jagg_patch.upstream --jagg_fingerprint FILE` against UPSTREAM_*.
"""
import importlib
import inspect
from dataclasses import dataclass

# (module attribute, its expected parameter names). `policy_update` is replaced at
# run time, and `select_train_steps` too under the window grouping; `build_parser` and
# `main` are what the launcher calls; `train_one_step` and `FAMILY` (the model family
# class) are what the diagnostics drive.
SEAMS = (
    ("policy_update", ("batch",)),
    ("select_train_steps", ("num_samples", "num_transitions", "timestep_fraction", "generator")),
    ("build_parser", ()),
    ("main", ("args",)),
    ("train_one_step", ("ctx",)),
    ("FAMILY", ("args",)),
)
# Fields of the seam's argument / result that the JAGG update reads or fills.
UPDATE_BATCH_FIELDS = ("predict", "step_loss", "steps", "timesteps", "subset", "backward", "rollout_output",
                       "on_policy", "predict_batched", "step", "parameters", "counted_apart", "gradient_probe")
UPDATE_STATS_FIELDS = ("loss", "backward_calls", "jagg_groups", "exact_groups", "forwards_reused", "metrics")
TRAIN_SELECTION_FIELDS = ("steps", "num_train")
# Fields of dancegrpo.build.TrainContext (the trainer's state) that the tools read.
TRAIN_CONTEXT_FIELDS = ("args", "family", "transformer", "raw_transformer", "device", "counter", "timesteps", "step",
                        "world_size", "engine", "num_params", "ratio_meter")
# Everything else of dancegrpo that jagg_patch, its launchers and its tools use (tests check that
# nothing outside this list is imported): (module, name, its parameter names, or None for a class or
# constant). The tools prepare their update as the loop does, through trainer.prepare_update.
DANCEGRPO_USES = (
    ("dancegrpo", "TRAINERS", None),
    ("dancegrpo.args", "parse_args", ("parser", "argv")),
    ("dancegrpo.args", "join_negative_values", ("argv",)),
    ("dancegrpo.utils.fsdp_util", "clean_param_name", ("name",)),
    ("dancegrpo.utils.launch", "launch_rank", ()),
    ("dancegrpo.utils.launch", "launch_world_size", ()),
    ("dancegrpo.utils.launch", "print_on_rank0", ("message", "file")),
    ("dancegrpo.errors", "say", ("message", "file")),
    ("dancegrpo.utils.lazy", "lazy_exports", ("package", "exports")),
    ("dancegrpo.utils.communications", "all_reduce_max", ("value", "device")),
    ("dancegrpo.utils.communications", "all_reduce_mean", ("value", "device")),
    ("dancegrpo.utils.communications", "sum_over_ranks", ("counts", "device")),
    ("dancegrpo.utils.communications", "world_size", ()),
    ("dancegrpo.utils.precision", "bytes_per_output", ("gpu", "mixed_precision")),
    ("dancegrpo.utils.precision", "describe_precision", ("device", "mixed_precision")),
    ("dancegrpo.errors", "ConfigError", None),
    ("dancegrpo.errors", "DiskFullError", None),
    ("dancegrpo.errors", "RunHalted", None),
    ("dancegrpo.errors", "is_disk_full", ("error",)),
    ("dancegrpo.errors", "exit_on_config_error", ("fn",)),
    ("dancegrpo.run.rundir", "check_writable", ("output_dir", "flag")),
    ("dancegrpo.utils.command_line", "CommandParser", None),
    ("dancegrpo.engines.probe", "GradProbe", ("params",)),
    ("dancegrpo.engines.base", "Engine", None),
    ("dancegrpo.algo.grpo", "TrainSelection", None),
    ("dancegrpo.algo.grpo", "UpdateBatch", None),
    ("dancegrpo.algo.grpo", "UpdateStats", None),
    ("dancegrpo.algo.grpo", "num_train_timesteps", ("num_transitions", "timestep_fraction")),
    ("dancegrpo.algo.grpo", "policy_update", ("batch",)),
    ("dancegrpo.algo.grpo", "ppo_clip_loss", ("log_prob", "old_log_prob", "advantages", "clip_range", "adv_clip_max")),
    ("dancegrpo.algo.grpo", "select_train_steps", ("num_samples", "num_transitions", "timestep_fraction", "generator")),
    ("dancegrpo.algo.grpo", "wants_rollout_outputs", ("update",)),
    ("dancegrpo.algo.objective", "measured_apart", ("counter", "ratio_meter")),
    ("dancegrpo.algo.ratio_stats", "RatioMeter", None),
    ("dancegrpo.algo.rollout", "predict_velocity", ("ctx", "latents", "timesteps", "cond")),
    ("dancegrpo.utils.activation_meter", "ActivationMeter", None),
    ("dancegrpo.utils.metrics", "PassCounter", None),
    ("dancegrpo.utils.metrics", "append_line", ("path", "line")),
    ("dancegrpo.utils.atomic", "write_text", ("path", "text")),
    ("dancegrpo.utils.metrics", "drop_torn_tail", ("path",)),
    ("dancegrpo.utils.metrics", "first_tensor", ("output",)),
    ("dancegrpo.utils.metrics", "phase_times", ("t_start", "t_rollout", "t_end")),
    ("dancegrpo.utils.metrics", "reward_summary", ("rewards",)),
    ("dancegrpo.utils.metrics", "update_counts", ("counter", "stats", "samples")),
    ("dancegrpo.utils.plots", "moving_average", ("values", "window")),
    ("dancegrpo.utils.plots", "plot_mean_spread", ("path", "panels", "title")),
    ("dancegrpo.utils.plots", "plot_reward_curves", ("path", "curves")),
    ("dancegrpo.utils.plots", "save_figure", ("fig", "path", "title")),
    ("dancegrpo.build", "TrainContext", None),
    ("dancegrpo.trainer", "PreparedUpdate", None),
    ("dancegrpo.trainer", "Rollout", None),
    ("dancegrpo.trainer", "accumulate_policy_gradient", ("ctx", "rollout", "cond", "advantages", "sample_idx", "steps",
                                                         "normaliser", "policy_update", "on_policy")),
    ("dancegrpo.trainer", "make_update_batch", ("ctx", "rollout", "cond", "advantages", "sample_idx", "steps",
                                                "normaliser", "on_policy")),
    ("dancegrpo.trainer", "optimizer_step", ("ctx", "where")),
    ("dancegrpo.trainer", "prepare_update", ("ctx", "select_train_steps", "keep_outputs", "step")),
    ("dancegrpo.trainer", "sample_reference_model", ("ctx", "cond", "captions", "generator", "keep_outputs")),
    ("dancegrpo.trainer", "setup", ("args", "family", "plan")),
    ("dancegrpo.trainer", "step_generators", ("ctx", "step")),
    ("dancegrpo.trainer", "train_selection", ("ctx", "rollout", "host_gen", "select_train_steps")),
)
PREPARED_UPDATE_FIELDS = ("cond", "captions", "rollout", "advantages", "selection", "normaliser", "selection_rng")
# The trainer keeps the rollout's model outputs (UpdateBatch.rollout_output) for a policy_update
# whose attribute says it reads them; dancegrpo's own policy_update declares False.
POLICY_UPDATE_ATTRIBUTES = ("uses_rollout_outputs",)
# --jagg_deferred wraps the engine's optimizer_step (on the run's engine object) so that the deferred
# proxy flushes before the engine's clip reads which parameters have a gradient
# (jagg_patch.trainer_deferred): (method of dancegrpo.engines.base.Engine, its parameters).
ENGINE_SEAMS = (("optimizer_step", ("self", "check_norm")),)
# A patched policy_update may carry state across steps (its state_dict / load_state_dict: JAGG's auto
# routing); the trainer saves it with each checkpoint and restores it on resume through these.
POLICY_UPDATE_STATE = ("update_state", "restore_update_state")


class SeamError(RuntimeError):
    """dancegrpo no longer offers a seam the patch relies on."""


def _param_names(obj):
    return tuple(p.name for p in inspect.signature(obj).parameters.values())


def _check_fields(cls, expected):
    names = set(getattr(cls, "__dataclass_fields__", {}))
    missing = [f for f in expected if f not in names]
    if missing:
        raise SeamError(f"{cls.__module__}.{cls.__name__} lacks fields {missing} that jagg_patch uses")


def check_seams(module):
    """Verify a trainer module (object or dotted name) still has every seam with the expected signature."""
    if isinstance(module, str):
        module = importlib.import_module(module)
    for name, params in SEAMS:
        obj = getattr(module, name, None)
        if obj is None or not callable(obj):
            raise SeamError(f"{module.__name__} has no callable {name!r}; jagg_patch needs it (see jagg_patch.seams)")
        found = _param_names(obj)
        if found != params:
            raise SeamError(f"{module.__name__}.{name} takes {found}, jagg_patch expects {params} "
                            "(see jagg_patch.seams)")
    from dancegrpo.algo import grpo
    from dancegrpo.algo.grpo import TrainSelection, UpdateBatch, UpdateStats
    for attribute in POLICY_UPDATE_ATTRIBUTES:
        if not hasattr(grpo.policy_update, attribute):
            raise SeamError(f"dancegrpo.algo.grpo.policy_update lacks the attribute {attribute!r} that tells the "
                            "trainer what jagg_patch's update reads (see jagg_patch.seams)")
    for name in POLICY_UPDATE_STATE:
        if not callable(getattr(grpo, name, None)):
            raise SeamError(f"dancegrpo.algo.grpo has no {name!r}: the trainer would not keep the patched update's "
                            "state across a resume (--jagg_frac auto's routing; see jagg_patch.seams)")
    from dancegrpo.engines.base import Engine
    for name, params in ENGINE_SEAMS:
        method = getattr(Engine, name, None)
        if not callable(method) or _param_names(method) != params:
            raise SeamError(f"dancegrpo.engines.base.Engine.{name} is not {name}{params}: --jagg_deferred flushes "
                            "before it (see jagg_patch.seams.ENGINE_SEAMS)")
    _check_fields(UpdateBatch, UPDATE_BATCH_FIELDS)
    _check_fields(UpdateStats, UPDATE_STATS_FIELDS)
    _check_fields(TrainSelection, TRAIN_SELECTION_FIELDS)
    from dancegrpo.build import TrainContext
    _check_fields(TrainContext, TRAIN_CONTEXT_FIELDS)
    check_uses()
    return module


def check_uses():
    """Every name of DANCEGRPO_USES is there, with the expected parameters."""
    for module_name, name, params in DANCEGRPO_USES:
        obj = getattr(importlib.import_module(module_name), name, None)
        if obj is None:
            raise SeamError(f"{module_name} has no {name!r}; jagg_patch uses it (see jagg_patch.seams.DANCEGRPO_USES)")
        if params is not None and _param_names(obj) != params:
            raise SeamError(f"{module_name}.{name} takes {_param_names(obj)}, jagg_patch expects {params} "
                            "(see jagg_patch.seams.DANCEGRPO_USES)")
    from dancegrpo.trainer import PreparedUpdate
    _check_fields(PreparedUpdate, PREPARED_UPDATE_FIELDS)


# ---------------------------------------------------------------- upstream DanceGRPO checkouts
# What jagg_patch.upstream relies on in an unmodified upstream trainer file, per trainer family, as of
# upstream commit UPSTREAM_COMMIT and in every release since open-sourcing (UPSTREAM_RELEASES):
# `train_one_step` is replaced by a function with the same parameters; `sample_reference_model`,
# `grpo_one_step` and `gather_tensor` are called; `flux_step` is what grpo_one_step runs on the
# stand-in transformer output (listed where the references name it). The family is told by
# train_one_step's parameters (UPSTREAM_FAMILY_PARAMETERS, the most specific first).
UPSTREAM_COMMIT = "15cc71d"
_FLUX_STEP = ("model_output", "latents", "eta", "sigmas", "index", "prev_sample", "grpo", "sde_solver")
_FLUX_TRAIN = ("args", "device", "transformer", "vae", "reward_model", "tokenizer", "optimizer", "lr_scheduler",
               "loader", "noise_scheduler", "max_grad_norm", "preprocess_val", "ema_handler")
_FLUX_SAMPLE = ("args", "device", "transformer", "vae", "encoder_hidden_states", "pooled_prompt_embeds", "text_ids",
                "reward_model", "tokenizer", "caption", "preprocess_val")
_FLUX_GRPO = ("args", "latents", "pre_latents", "encoder_hidden_states", "pooled_prompt_embeds", "text_ids",
              "image_ids", "transformer", "timesteps", "i", "sigma_schedule")
_QWEN_TRAIN = ("args", "device", "transformer", "vae", "reward_model", "tokenizer", "optimizer", "lr_scheduler",
               "prompt_embeds", "prompt_attention_masks", "caption", "original_length", "noise_scheduler",
               "max_grad_norm", "preprocess_val", "ema_handler")
_QWEN_SAMPLE = ("args", "device", "transformer", "vae", "encoder_hidden_states", "prompt_attention_masks",
                "original_length", "reward_model", "tokenizer", "caption", "preprocess_val")
_QWEN_GRPO = ("args", "latents", "pre_latents", "encoder_hidden_states", "prompt_attention_masks", "txt_seq_lens",
              "img_shapes", "transformer", "timesteps", "i", "sigma_schedule")
_EDIT_INPUTS = ("calculated_height", "calculated_width", "image_latents")
_HUNYUAN_TRAIN = ("args", "device", "transformer", "vae", "inferencer", "optimizer", "lr_scheduler", "loader",
                  "max_grad_norm", "step")
_SKYREELS_TRAIN = ("args", "device", "transformer", "pipe_flux", "vae", "inferencer", "optimizer", "lr_scheduler",
                   "loader", "max_grad_norm", "step", "empty_cond_hidden_states", "empty_cond_attention_mask")
# train_one_step's parameter lists as the family's releases have them, newest first (Flux before
# 2145e4f, and the LoRA trainer: without ema_handler).
UPSTREAM_TRAIN_ONE_STEP = {
    "flux": (_FLUX_TRAIN, _FLUX_TRAIN[:-1]),
    "qwenimage": (_QWEN_TRAIN,),
    "qwenimage_edit": (_QWEN_TRAIN[:12] + _EDIT_INPUTS + _QWEN_TRAIN[12:],),
    "wan": (("args", "device", "transformer", "vae", "reward_model", "tokenizer", "optimizer", "lr_scheduler",
             "encoder_hidden_states", "negative_prompt_embeds", "caption", "noise_scheduler", "max_grad_norm",
             "preprocess_val"),),
    "hunyuan": (_HUNYUAN_TRAIN,),
    "skyreels_i2v": (_SKYREELS_TRAIN,),
}
# The parameters that tell a family's train_one_step apart, tested in this order (Qwen-Image-Edit's
# has every parameter of Qwen-Image's).
UPSTREAM_FAMILY_PARAMETERS = (("qwenimage_edit", ("prompt_embeds", "image_latents")),
                              ("qwenimage", ("prompt_embeds",)),
                              ("wan", ("negative_prompt_embeds",)),
                              ("skyreels_i2v", ("inferencer", "empty_cond_hidden_states")),
                              ("hunyuan", ("inferencer", "loader")),
                              ("flux", ("loader",)))
UPSTREAM_SEAMS = {
    "flux": {"sample_reference_model": _FLUX_SAMPLE, "grpo_one_step": _FLUX_GRPO, "flux_step": _FLUX_STEP},
    "qwenimage": {"sample_reference_model": _QWEN_SAMPLE, "grpo_one_step": _QWEN_GRPO, "flux_step": _FLUX_STEP},
    "qwenimage_edit": {"sample_reference_model": _QWEN_SAMPLE[:7] + _EDIT_INPUTS + _QWEN_SAMPLE[7:],
                       "grpo_one_step": _QWEN_GRPO[:7] + ("image_latents",) + _QWEN_GRPO[7:],
                       "flux_step": _FLUX_STEP},
    "wan": {"sample_reference_model": ("args", "device", "transformer", "vae", "encoder_hidden_states",
                                       "negative_prompt_embeds", "reward_model", "tokenizer", "caption",
                                       "preprocess_val"),
            "grpo_one_step": ("args", "latents", "pre_latents", "encoder_hidden_states", "negative_prompt_embeds",
                              "transformer", "timesteps", "i", "sigma_schedule")},
    "hunyuan": {"sample_reference_model": ("args", "step", "device", "transformer", "vae", "encoder_hidden_states",
                                           "encoder_attention_mask", "inferencer", "caption"),
                "grpo_one_step": ("args", "latents", "pre_latents", "encoder_hidden_states", "encoder_attention_mask",
                                  "transformer", "timesteps", "i", "sigma_schedule"),
                "flux_step": _FLUX_STEP},
    "skyreels_i2v": {"sample_reference_model": ("args", "step", "device", "transformer", "pipe_flux", "vae",
                                                "encoder_hidden_states", "encoder_attention_mask",
                                                "empty_cond_hidden_states", "empty_cond_attention_mask", "inferencer",
                                                "caption"),
                     "grpo_one_step": ("args", "latents", "pre_latents", "encoder_hidden_states",
                                       "encoder_attention_mask", "empty_cond_hidden_states",
                                       "empty_cond_attention_mask", "transformer", "timesteps", "i", "sigma_schedule",
                                       "first_frame_latents"),
                     "flux_step": _FLUX_STEP},
}
# Functions called by the adapter whose parameter names it does not rely on (one positional argument).
UPSTREAM_CALLED = ("gather_tensor",)
# The values sample_reference_model returns: (rewards, all_latents, all_log_probs, sigma_schedule, then
# Flux: all_image_ids | Qwen-Image: all_txt_seq_lens | Qwen-Image-Edit: all_txt_seq_lens, all_image_latents |
# Wan: nothing more); HunyuanVideo: (videos, z, vq, mq, all_latents, all_log_probs, sigma_schedule);
# SkyReels-I2V: (videos, z, rewards, all_latents, all_log_probs, sigma_schedule, first_frame_latents).
# The rewards train_one_step reports, one reward file each, in its order (every other family: one, "reward").
UPSTREAM_REWARD_NAMES = {"hunyuan": ("vq", "mq")}
UPSTREAM_ROLLOUT_VALUES = {"flux": 5, "qwenimage": 5, "qwenimage_edit": 6, "wan": 4, "hunyuan": 7, "skyreels_i2v": 7}
# Upstream's trainer files: those the adapter runs, and those it refuses (other shapes).
UPSTREAM_TRAINER_FILES = {"train_grpo_flux.py": "flux", "train_grpo_flux_lora.py": "flux",
                          "train_grpo_qwenimage.py": "qwenimage", "train_grpo_qwenimage_edit.py": "qwenimage_edit",
                          "train_grpo_wan_2_1.py": "wan", "train_grpo_hunyuan.py": "hunyuan",
                          "train_grpo_skyreels_i2v.py": "skyreels_i2v"}
# Upstream's trainers without a train_one_step: their loop inline in an absl main(), the model prepared by
# accelerate. jagg_patch.upstream runs them as they are, the prepared model behind the deferred proxy
# (jagg_patch.deferred.prepare), told by name before they are imported.
UPSTREAM_PREPARE_FILES = {
    "train_grpo_sd.py": "upstream's Stable Diffusion DDIM trainer, whose loop is inline in main()",
}


@dataclass(frozen=True)
class UpstreamRelease:
    """One known source of upstream's train_one_step: its token hash (jagg_patch.upstream.tokenhash),
    family, the files and commits that have it, its parameter list and the reward files it appends to,
    in its order."""
    token_hash: str
    family: str
    commits: str
    parameters: tuple
    reward_files: tuple


@dataclass(frozen=True)
class OwnStepRelease:
    """A release the restated step is not written for, known by name: its train_one_step's token hash,
    its file and parameter count, what it is."""
    token_hash: str
    file: str
    parameters: int
    reason: str


# Every release of train_one_step since open-sourcing, newest first within a family: the releases the
# restated step is written for. A file whose train_one_step hashes to none of these runs as it is, with
# its backward deferred (jagg_patch.upstream.own_step), said in one line naming the nearest of its family.
UPSTREAM_RELEASES = (
    UpstreamRelease("ac4b353cdcc7f665", "flux", "train_grpo_flux.py 2145e4f .. 15cc71d", _FLUX_TRAIN,
                    ("./reward.txt",)),
    UpstreamRelease("289a6c265fedb7c7", "flux", "train_grpo_flux.py bbf5278, train_grpo_flux_lora.py ff7bee1 .. "
                    "15cc71d", _FLUX_TRAIN[:-1], ("./reward.txt",)),
    UpstreamRelease("c7a2fcac1dc57e74", "flux", "train_grpo_flux.py 93ec253 .. 2af04bd", _FLUX_TRAIN[:-1],
                    ("./hps_reward.txt",)),
    UpstreamRelease("465f923956336644", "qwenimage", "train_grpo_qwenimage.py 9679174 .. 15cc71d", _QWEN_TRAIN,
                    ("./reward.txt",)),
    UpstreamRelease("ff2ee0b57cf90003", "qwenimage_edit", "train_grpo_qwenimage_edit.py 46f02b8 .. 15cc71d",
                    UPSTREAM_TRAIN_ONE_STEP["qwenimage_edit"][0], ("./reward.txt",)),
    UpstreamRelease("127e437113921902", "wan", "train_grpo_wan_2_1.py 2d3371a .. 15cc71d",
                    UPSTREAM_TRAIN_ONE_STEP["wan"][0], ("./reward.txt",)),
    UpstreamRelease("fae5119519022108", "hunyuan", "train_grpo_hunyuan.py be8cf11 .. 15cc71d", _HUNYUAN_TRAIN,
                    ("./vq_reward.txt", "./mq_reward.txt")),
    UpstreamRelease("f6253f76230e7ee4", "skyreels_i2v", "train_grpo_skyreels_i2v.py 61afbf2 .. 15cc71d",
                    _SKYREELS_TRAIN, ("./reward.txt",)),
)
# Releases of a supported file that are another trainer than the one the adapter restates (its family
# cannot be told by its parameters, whose names are not known here): they run as they are, with their
# backward deferred, told by the token hash of their train_one_step or by their file name and parameter count.
UPSTREAM_OWN_STEP_RELEASES = (
    OwnStepRelease("f03e20a33286d92c", "train_grpo_hunyuan.py", 26,
                   "the HunyuanVideo trainer of 93ec253 (2025-05-28, the open-sourcing release), a different, older "
                   "trainer (its train_one_step takes 26 parameters) than the restated one (be8cf11 on)"),
)
