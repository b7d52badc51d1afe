"""The values the command line offers, importable without torch: the parser is built from these,
so --help and a flag error answer before torch loads. The modules that implement them keep their
own tables (kernels.KERNELS, advantages.ADVANTAGES, engines.ENGINE_MODULES, ...); a test checks
that each table offers exactly these."""

SDE_TYPES = ("dance", "flow_grpo", "cps")                   # dancegrpo.algo.kernels.KERNELS
ADVANTAGE_RULES = ("dance", "flow_grpo")                    # dancegrpo.algo.advantages.ADVANTAGES
PRECISIONS = ("no", "fp16", "bf16")                         # dancegrpo.utils.precision
SHARDING_STRATEGIES = ("full", "hybrid_full", "hybrid_zero2", "none")   # dancegrpo.utils.fsdp_util
WEIGHT_TYPES = ("fp32", "bf16")                             # dancegrpo.utils.fsdp_util
