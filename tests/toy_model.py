"""A causal LM that is not in transformers, for the walk-through in docs/extending.md.

Its attention does its own arithmetic (one fused projection, no shared attention function, a boolean causal mask
filled with -inf), its modules have names no built-in family uses, so attnlens knows nothing about it until a family
is added.
"""

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
    torch.manual_seed(seed)
    return ToyForCausalLM(ToyConfig()).eval()
