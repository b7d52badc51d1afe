"""What a trainer module (train_grpo_flux.py, ...) is made of: its parser, importable at once, and
its family and loop seams (FAMILY, policy_update, select_train_steps, train_one_step, main; see
dancegrpo.trainer.trainer_entry), which load torch and diffusers and so load on first use: --help
and a flag error answer in a tenth of a second. jagg_patch replaces the seams as module attributes;
an attribute set so is never overwritten by the first use."""
import importlib
import sys

SEAM_NAMES = ("policy_update", "select_train_steps", "train_one_step", "main")


def trainer_attributes(module_name, family_module, family_class):
    """The trainer module's __getattr__ (PEP 562): the first use of any of FAMILY and SEAM_NAMES
    binds all of them that the module does not hold yet."""
    names = ("FAMILY", *SEAM_NAMES)

    def __getattr__(name):
        if name not in names:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        module = sys.modules[module_name]
        family = getattr(importlib.import_module(family_module), family_class)
        seams = importlib.import_module("dancegrpo.trainer").trainer_entry(module_name)
        for key, value in zip(names, (family, *seams)):
            module.__dict__.setdefault(key, value)
        return module.__dict__[name]
    return __getattr__


def run_trainer(module_name):
    """`python -m` of a trainer module: parse (before torch loads), then its main, each user error
    one line (dancegrpo.errors.exit_on_config_error)."""
    from .errors import exit_on_config_error
    module = sys.modules[module_name]
    args = exit_on_config_error(module.parse_args)(module.build_parser())
    exit_on_config_error(module.main)(args)
