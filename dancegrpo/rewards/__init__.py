"""Reward registry: name -> factory(device, options) -> callable(images, prompts) -> Tensor[N] float32.

Built-in rewards need no weights. Model-based rewards (hpsv2, pickscore,
clipscore) are registered lazily by module path so that their heavy imports
happen only when they are used; torch itself is imported where a reward is scored,
so that the command line's flags (add_reward_args) load without it.
"""
import importlib
import math

from ..errors import ConfigError, NonFiniteError

_FACTORIES = {}
_LAZY = {
    "hpsv2": "dancegrpo.rewards.hpsv2:build",
    "pickscore": "dancegrpo.rewards.pickscore:build",
    "clipscore": "dancegrpo.rewards.clipscore:build",
    "digit": "dancegrpo.rewards.digit:build_digit",
    "digit_heldout": "dancegrpo.rewards.digit:build_heldout",
}

# Rewards that read something from the prompt name a check of the prompts, run before training.
_PROMPT_CHECKS = {
    "digit": "dancegrpo.rewards.digit:check_prompts",
    "digit_heldout": "dancegrpo.rewards.digit:check_prompts",
}


def check_reward_prompts(terms, read_captions, source):
    """ConfigError when a reward in `terms` cannot score the prompts (each reward's own rule);
    read_captions() -> the prompts, or None when they cannot be read. Only called when a reward
    has a rule."""
    checked = [name for name, _ in terms if name in _PROMPT_CHECKS]
    captions = read_captions() if checked else None
    for name in checked if captions else []:
        module, attr = _PROMPT_CHECKS[name].split(":")
        getattr(importlib.import_module(module), attr)(name, captions, source)


def register_reward(name):
    """Decorator: register `factory(device, options) -> reward_fn` under `name`."""
    def wrap(factory):
        _FACTORIES[name] = factory
        return factory
    return wrap


def available_rewards():
    return sorted(set(_FACTORIES) | set(_LAZY))


def _factory(name):
    if name in _FACTORIES:
        return _FACTORIES[name]
    if name in _LAZY:
        module, attr = _LAZY[name].split(":")
        return getattr(importlib.import_module(module), attr)
    raise ConfigError(f"Unknown reward {name!r}. Available: {', '.join(available_rewards())}")


def parse_reward_spec(spec):
    """'hpsv2=1.0,jpeg=0.5' -> [('hpsv2', 1.0), ('jpeg', 0.5)]; a bare name has weight 1."""
    terms = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = part.partition("=")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ConfigError(f"Bad reward weight in {part!r}; use name=weight, e.g. hpsv2=1.0") from None
        if not math.isfinite(w):
            raise ConfigError(f"Reward weight in {part!r} is not a finite number; use e.g. {name.strip()}=1.0")
        terms.append((name.strip(), w))
    if terms and all(w == 0 for _, w in terms):
        raise ConfigError(f"Every reward weight in {spec!r} is 0: nothing would be learned; give a term a "
                          "non-zero weight")
    if not terms:
        raise ConfigError("No reward given: pass --reward NAME[=WEIGHT],... "
                         f"(available: {', '.join(available_rewards())})")
    names = [n for n, _ in terms]
    if len(set(names)) != len(names):
        raise ConfigError(f"Reward named twice in {spec!r}")
    for name in names:
        if name not in available_rewards():
            raise ConfigError(f"Unknown reward {name!r}. Available: {', '.join(available_rewards())}")
    return terms


class RewardNotFiniteError(NonFiniteError):
    """A reward model returned NaN/inf: the step stops before it reaches the update
    (a user-facing error: it points at the reward model's weights or inputs)."""


class WeightedReward:
    """sum_i w_i * reward_i(images, prompts), each term kept for logging."""

    def __init__(self, terms, device, options=None):
        self.terms = [(name, w, _factory(name)(device, options)) for name, w in terms]
        self.last_terms = {}

    def __call__(self, images, prompts):
        import torch
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        total = torch.zeros(len(images), dtype=torch.float32)
        for name, weight, fn in self.terms:
            scores = torch.as_tensor(fn(images, prompts)).detach().float().cpu().reshape(-1)
            if scores.numel() != len(images):
                raise ValueError(f"Reward {name!r} returned {scores.numel()} scores for {len(images)} images")
            if not torch.isfinite(scores).all():
                bad = [i for i, s in enumerate(scores.tolist()) if not math.isfinite(s)]
                raise RewardNotFiniteError(
                    f"Reward {name!r} returned NaN/inf for images {bad[:8]} (prompts: "
                    f"{[prompts[i] for i in bad[:3]]}). The step was stopped before the policy update; "
                    "check the reward model's weights and inputs.")
            self.last_terms[name] = scores
            total += weight * scores
        return total


def add_reward_args(parser):
    """Flags of the reward models (their checkpoint locations)."""
    g = parser.add_argument_group("rewards")
    g.add_argument("--reward", type=str, default=None,
                   help="Weighted rewards, e.g. 'hpsv2=1.0,pickscore=0.5'. Available: "
                        + ", ".join(available_rewards()) + ". --use_hpsv2/--use_pickscore map onto this.")
    g.add_argument("--hps_ckpt_dir", type=str, default="./hps_ckpt",
                   help="hpsv2 reward: folder holding HPS_v2.1_compressed.pt (hf download xswu/HPSv2). "
                        "open_clip_pytorch_model.bin may sit there too but is not needed: the HPS state dict "
                        "holds every weight.")
    g.add_argument("--hps_arch", type=str, default="ViT-H-14",
                   help="hpsv2 reward: open_clip architecture name, or a path to an open_clip model-config JSON.")
    g.add_argument("--pickscore_processor_path", type=str, default="./pickscore_ckpt/processor",
                   help="pickscore reward: local CLIP processor folder (laion/CLIP-ViT-H-14-laion2B-s32B-b79K).")
    g.add_argument("--pickscore_model_path", type=str, default="./pickscore_ckpt/model",
                   help="pickscore reward: local model folder (yuvalkirstain/PickScore_v1).")
    g.add_argument("--clipscore_model_path", type=str, default="./clip_ckpt",
                   help="clipscore reward: local transformers CLIP folder (e.g. openai/clip-vit-large-patch14); "
                        "score = 100 * max(cos, 0).")
    g.add_argument("--clipscore_processor_path", type=str, default=None,
                   help="clipscore reward: processor folder if it differs from --clipscore_model_path.")
    return g


def resolve_reward_spec(args):
    """Merge --reward with upstream's --use_hpsv2 / --use_pickscore into one spec."""
    terms = parse_reward_spec(args.reward) if args.reward else []
    for flag, name in (("use_hpsv2", "hpsv2"), ("use_pickscore", "pickscore")):
        if getattr(args, flag, False) and name not in {n for n, _ in terms}:
            terms.append((name, 1.0))
    if not terms:
        raise ConfigError("No reward chosen: pass --reward NAME[=WEIGHT],... or --use_hpsv2 / --use_pickscore "
                         f"(available: {', '.join(available_rewards())}).")
    return terms


from . import builtin  # noqa: E402,F401  (registers the built-in rewards)
