"""The transformer's compute precision (--mixed_precision), decided in one place: the dtype a run
computes in on its device, the autocast that gives it (the rollout, the update, the monitor, the
tools, evaluation), the VAE decode's context, and how the banner says it.

On GPU a run computes under bf16 autocast unless --mixed_precision is 'no' (upstream's recipes: bf16
autocast everywhere). On CPU the default is float32 (bf16 gives no speedup there); an explicit
`--mixed_precision bf16` enters torch.autocast("cpu", torch.bfloat16), which has a GPU's numerics
class (bf16 matmul inputs and outputs, float32 accumulation, the same ops kept in float32), so the
dtype paths a GPU run takes run and are tested on CPU. fp16 is for GPUs only: CPU autocast in fp16
without a GPU's loss scaling is not what a GPU run computes.
"""
import contextlib

import torch

from ..choices import PRECISIONS as CHOICES  # noqa: F401  (the flag's choices, read by the tests)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def on_gpu(device):
    return torch.device(device).type == "cuda"


def check_precision(mixed_precision, gpu=None):
    """A ValueError naming the fix for a precision the device cannot run (fp16 without a GPU)."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    if mixed_precision == "fp16" and not gpu:
        raise ValueError("--mixed_precision fp16 needs a GPU (CPU autocast has no fp16 loss scaling); use "
                         "--mixed_precision bf16 for a GPU's numerics on CPU, or no for float32")


def compute_dtype(device, mixed_precision=None):
    """torch.bfloat16 / torch.float16 where the transformer computes under autocast, None for float32.
    mixed_precision None is the device's default: bf16 on GPU, float32 on CPU."""
    if mixed_precision == "no" or (mixed_precision is None and not on_gpu(device)):
        return None
    check_precision(mixed_precision, on_gpu(device))
    return _DTYPES.get(mixed_precision, torch.bfloat16)


def compute_autocast(device, mixed_precision=None):
    """The transformer's compute precision as a context manager, for training and evaluation alike."""
    dtype = compute_dtype(device, mixed_precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def decode_context(device, mixed_precision=None):
    """No grad, and the VAE decode under bf16 autocast as upstream decodes on GPU (whatever the
    transformer's precision) and as a CPU run in bf16 does; a float32 CPU run decodes in float32."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode())
    if on_gpu(device) or compute_dtype(device, mixed_precision) is not None:
        stack.enter_context(torch.autocast(torch.device(device).type, dtype=torch.bfloat16))
    return stack


def describe_precision(device, mixed_precision=None):
    """How the banner says what the transformer computes in, e.g. 'bf16 autocast' or 'float32'."""
    dtype = compute_dtype(device, mixed_precision)
    return "float32" if dtype is None else f"{'bf16' if dtype == torch.bfloat16 else 'fp16'} autocast"


def bytes_per_output(gpu, mixed_precision=None):
    """Bytes of one element of a transformer output (kept rollout outputs): 2 under autocast, else 4."""
    return 4 if compute_dtype("cuda" if gpu else "cpu", mixed_precision) is None else 2
