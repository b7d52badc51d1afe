# A stand-in for fastvideo's models/hunyuan_hf/modeling_hunyuan.py: a tiny video transformer with
# the HunyuanVideo model's call (hidden_states [b, C, T, H, W], encoder_hidden_states [b, 1 + L, D] whose
# row 0 holds the pooled text projection in its first features, integer timesteps [b], a guidance of
# one entry or one per row, encoder_attention_mask [b, 1 + L], return_dict), one block of patch
# tokens attending to the text tokens, modulated by the timestep, the guidance and the pooled text.
import math

import torch
from torch import nn

DEFAULT_GUIDANCE = 6016.0   # what fastvideo's model uses when guidance is None (6018 in bf16)


def _frequencies(values, dim):
    """Sinusoidal features of `values` [n] -> [n, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=values.dtype, device=values.device) / half)
    angles = values[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class HunyuanVideoTransformer3DModel(nn.Module):
    def __init__(self, in_channels=16, out_channels=16, text_dim=24, pooled_dim=8, hidden=32, freq_dim=16, seed=0):
        super().__init__()
        self.in_channels, self.out_channels, self.pooled_dim, self.freq_dim = in_channels, out_channels, pooled_dim, freq_dim
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.patch_in = nn.Linear(in_channels * 4, hidden)
            self.time_in = nn.Linear(freq_dim, hidden)
            self.guidance_in = nn.Linear(freq_dim, hidden)
            self.pooled_in = nn.Linear(pooled_dim, hidden)
            self.text_in = nn.Linear(text_dim, hidden)
            self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
            self.modulation = nn.Linear(hidden, 2 * hidden)
            self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(approximate="tanh"),
                                     nn.Linear(2 * hidden, hidden))
            self.norm = nn.LayerNorm(hidden, elementwise_affine=False)
            self.proj_out = nn.Linear(hidden, out_channels * 4)

    @property
    def dtype(self):
        return self.patch_in.weight.dtype

    def forward(self, hidden_states, encoder_hidden_states, timestep, guidance=None, encoder_attention_mask=None,
                return_dict=True):
        dtype = self.dtype
        b, c, t, h, w = hidden_states.shape
        if c != self.in_channels:
            raise ValueError(f"expected {self.in_channels} input channels, got {c}")
        x = hidden_states.to(dtype).reshape(b, c, t, h // 2, 2, w // 2, 2).permute(0, 2, 3, 5, 1, 4, 6)
        x = self.patch_in(x.reshape(b, t * (h // 2) * (w // 2), c * 4))
        if guidance is None:
            guidance = torch.tensor([DEFAULT_GUIDANCE], device=hidden_states.device)
        if guidance.shape[0] not in (1, b):
            raise RuntimeError(f"guidance of {guidance.shape[0]} entries cannot go with a batch of {b} rows")
        text = encoder_hidden_states.to(dtype)
        emb = (self.time_in(_frequencies(timestep.to(dtype), self.freq_dim))
               + self.guidance_in(_frequencies(guidance.to(dtype) / 1000, self.freq_dim))
               + self.pooled_in(text[:, 0, :self.pooled_dim]))
        tokens = self.text_in(text[:, 1:])
        x = x + emb[:, None]
        scores = self.q(x) @ self.k(tokens).transpose(1, 2) / math.sqrt(x.shape[-1])
        if encoder_attention_mask is not None:
            keep = encoder_attention_mask[:, 1:].to(torch.bool)[:, None, :]
            scores = scores.masked_fill(~keep, float("-inf"))
        x = x + self.o(torch.softmax(scores, dim=-1) @ self.v(tokens))
        shift, scale = self.modulation(torch.nn.functional.silu(emb))[:, None].chunk(2, dim=-1)
        x = x + self.mlp(self.norm(x) * (1 + scale) + shift)
        out = self.proj_out(x).reshape(b, t, h // 2, w // 2, self.out_channels, 2, 2)
        out = out.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, self.out_channels, t, h, w)
        return (out,) if not return_dict else {"sample": out}
