"""Two causal LMs that are not in transformers, for docs/extending.md's walk-throughs (they ship with the package, so
the page runs from an installed wheel).

Their attention does its own arithmetic under module names no built-in family uses, so attnlens knows nothing about
them until a family is added:

- `toy_model()`: one fused projection unbound into queries, keys and values, a boolean causal mask filled with -inf,
  LayerNorm blocks (`blocks[i].mix`, `blocks[i].ff`).
- `gated_toy_model()`: a fused projection split into 4 query and 2 key/value heads, its own masked softmax, a learned
  gate per head and token before the output projection, RMSNorms whose gain is named `g`, modules under
  `model.blocks[i].mixer` / `.ff`, a config that says `width` where transformers says `hidden_size`, and no
  `get_input_embeddings` of its own.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class ToyConfig(PretrainedConfig):
    model_type = "toy_lm"

    def __init__(self, vocab_size=128, width=64, depth=2, heads=4, **kwargs):
        self.vocab_size, self.width, self.depth, self.heads = vocab_size, width, depth, heads
        self.num_hidden_layers = depth
        super().__init__(**kwargs)


class ToyAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.head_size = config.heads, config.width // config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.out = nn.Linear(config.width, config.width)

    def forward(self, x):
        batch, length, _ = x.shape
        fused = self.qkv(x).view(batch, length, 3, self.heads, self.head_size).permute(2, 0, 3, 1, 4)
        queries, keys, values = fused.unbind(0)
        logits = torch.matmul(queries, keys.transpose(-1, -2)) * self.head_size**-0.5
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        logits = logits.masked_fill(future, float("-inf"))
        pattern = torch.softmax(logits, dim=-1)
        mixed = torch.matmul(pattern, values).transpose(1, 2)
        merged = mixed.reshape(batch, length, -1)
        return self.out(merged)


class ToyBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        width = config.width
        self.norm_a, self.mix, self.norm_b = nn.LayerNorm(width), ToyAttention(config), nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.mix(self.norm_a(x))
        return x + self.ff(self.norm_b(x))


class ToyForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = ToyConfig

    def __init__(self, config):
        super().__init__(config)
        self.tokens = nn.Embedding(config.vocab_size, config.width)
        self.blocks = nn.ModuleList(ToyBlock(config) for _ in range(config.depth))
        self.norm = nn.LayerNorm(config.width)
        self.unembed = nn.Linear(config.width, config.vocab_size, bias=False)

    def get_input_embeddings(self):
        return self.tokens

    def forward(self, input_ids, attention_mask=None, **kwargs):
        x = self.tokens(input_ids)
        for block in self.blocks:
            x = block(x)
        return CausalLMOutput(logits=self.unembed(self.norm(x)))


def toy_model(seed: int = 0) -> ToyForCausalLM:
    """The fused-projection toy (`toy_lm`), seeded."""
    torch.manual_seed(seed)
    return ToyForCausalLM(ToyConfig()).eval()


# --- the gated toy ------------------------------------------------------------------------------------------------


class GatedConfig(PretrainedConfig):
    model_type = "gated_toy"

    def __init__(self, vocab_size=128, width=64, depth=2, heads=4, kv_heads=2, **kwargs):
        self.vocab_size, self.width, self.heads, self.kv_heads = vocab_size, width, heads, kv_heads
        self.num_hidden_layers = depth
        super().__init__(**kwargs)


class GainNorm(nn.Module):
    """An RMSNorm whose gain is `g`."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.g, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x):
        return self.g * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class GatedAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_q, self.n_kv = config.heads, config.kv_heads
        self.d = config.width // config.heads
        self.scale = self.d**-0.5
        self.qkv = nn.Linear(config.width, (self.n_q + 2 * self.n_kv) * self.d, bias=False)
        self.gate = nn.Linear(config.width, self.n_q)
        self.out = nn.Linear(self.n_q * self.d, config.width, bias=False)

    def forward(self, x):
        batch, length, _ = x.shape
        fused = self.qkv(x).view(batch, length, -1, self.d).transpose(1, 2)
        q, k, v = fused.split((self.n_q, self.n_kv, self.n_kv), dim=1)
        k_all, v_all = (t.repeat_interleave(self.n_q // self.n_kv, dim=1) for t in (k, v))
        logits = torch.matmul(q, k_all.transpose(-1, -2)) * self.scale
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        logits = logits.masked_fill(future, torch.finfo(logits.dtype).min)
        weights = torch.softmax(logits, dim=-1)
        heads = torch.matmul(weights, v_all).transpose(1, 2)
        gate = torch.sigmoid(self.gate(x))
        gated = heads * gate[..., None]
        return self.out(gated.reshape(batch, length, -1))


class GatedBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        width = config.width
        self.norm1, self.mixer, self.norm2 = GainNorm(width), GatedAttention(config), GainNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.SiLU(), nn.Linear(2 * width, width))

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + self.ff(self.norm2(x))


class GatedBody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.width)
        self.blocks = nn.ModuleList(GatedBlock(config) for _ in range(config.num_hidden_layers))
        self.norm_f = GainNorm(config.width)

    def forward(self, input_ids):
        x = self.wte(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.norm_f(x)


class GatedForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = GatedConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = GatedBody(config)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return CausalLMOutput(logits=self.lm_head(self.model(input_ids)))


def gated_toy_model(seed: int = 0) -> GatedForCausalLM:
    """The gated toy (`gated_toy`), seeded, its gains away from one (so a norm read without its gain shows)."""
    torch.manual_seed(seed)
    model = GatedForCausalLM(GatedConfig()).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GainNorm):
                module.g.uniform_(0.5, 1.5)
    return model
