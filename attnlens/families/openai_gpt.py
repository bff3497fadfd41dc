"""OpenAI GPT (GPT-1): a post-norm block, its own attention arithmetic, keys held transposed, learned positions and no
final norm.

The block normalises after each residual add: `n = ln_1(x + attn(x))`, `layer_output = ln_2(n + mlp(n))`. So
attention reads the block input itself (no `attention_norm_output`); `layer_mid` is `x + attention_output`, what
`ln_1` receives; `mlp_norm_output` is `ln_1`'s output, the MLP's input and also the stream the MLP's output is added
to, and `layer_output` is `ln_2` of that sum (`residual_add`). The last block's `ln_2` is the last norm: there is no
final norm, and `final_norm_output` does not exist.

`Attention._attn` computes the scores itself: `q @ k / sqrt(head_dim)`, with `k` already [batch, heads, head_dim,
seq]; the causal mask *replaces* future scores by -10000 (`w * b + -1e4 * (1 - b)`), then a padding mask holding the
dtype's minimum is added where one is given. The scores are read as the softmax's input; the keys are a transposed
view of the split (in-place edits land), and the head outputs a transposed view of `_attn`'s result.
"""

import torch

from ..family import Family, Tiny, VLLMLayout
from ..locations import Derived, ModuleInput, ModuleOutput, Operation
from ..parts import identities, scoring
from ..parts.sizes import Sizes
from ..parts.vllm import own_attention

ATTN = "self__attn_0"  # Attention._attn, called from Attention.forward


def _swap_last(envoy, tensor):
    return tensor.transpose(-1, -2)


def _swap_last_back(envoy, old, new):
    return new.transpose(-1, -2)


def _heads_last(envoy, per_head):
    return per_head.transpose(1, 2)


def _heads_first(envoy, old, new):
    return new.transpose(1, 2)


class OpenAIGPT(Family):
    model_types = ("openai-gpt",)
    vllm = VLLMLayout(refusal=own_attention("OpenAI GPT", "OpenAIGPTLMHeadModel", "its Attention._attn"))
    tiny = Tiny(
        "OpenAIGPTConfig",
        "OpenAIGPTLMHeadModel",
        {
            "n_layer": 3,
            "n_embd": 64,
            "n_head": 4,
            "n_positions": 128,
            "num_hidden_layers": None,
            "hidden_size": None,
            "num_attention_heads": None,
            "num_key_value_heads": None,
            "intermediate_size": None,
            "max_position_embeddings": None,
        },
    )
    layers = "transformer.h"
    embed_tokens = "transformer.tokens_embed"
    final_norm = None
    attention = "attn"
    attention_norm = None
    mlp_norm = "ln_1"
    output_projection = "c_proj"
    activation = "act"
    down_projection = "c_proj"
    absent = {
        **Family.absent,
        "attention_norm_output": "a post-norm block: attention reads the block input itself (layer_input); ln_1 "
        "normalises layer_input + attention_output after it",
        "final_norm_output": "no final norm: each block ends in its own ln_2, so the last layer_output is what the "
        "LM head reads",
    }
    sizes = Sizes(
        num_heads=("n_head",),
        num_kv_heads=("n_head",),
        head_dim=(lambda module, found: module.split_size // module.n_head,),
        scale=(lambda module, found: found["head_dim"] ** -0.5 if module.scale else 1.0,),
    )

    def locations(self):
        locations = super().locations()
        del locations["attention_norm_output"], locations["final_norm_output"]
        locations.update(
            {
                "attention_queries": Operation(("self_split_heads_0",), anchor="split_heads(query)"),
                "attention_keys": Derived(
                    Operation(("self_split_heads_1",), anchor="split_heads(key, k=True)"),
                    _swap_last,
                    _swap_last_back,
                    "attention_keys (held as [.., head_dim, seq])",
                ),
                "attention_values": Operation(("self_split_heads_2",), anchor="split_heads(value)"),
                "attention_scores": Operation((ATTN, "nn_functional_softmax_0"), "arg", 0, anchor="softmax(w"),
                "attention_probabilities": Operation((ATTN, "w_5"), anchor="attn_dropout(w)"),
                "attention_head_outputs": Derived(
                    Operation((ATTN,), "output", 0),
                    _heads_last,
                    _heads_first,
                    "attention_head_outputs (held heads first)",
                ),
                "attention_output": ModuleOutput("", 0),
                "layer_mid": ModuleInput(self.mlp_norm),
                # `act` is one module-level instance shared by every block: read its output as what c_proj receives
                "mlp_activation": ModuleInput(self.down_projection),
            }
        )
        return locations

    def drilled_functions(self, attention_module):
        return {ATTN: type(attention_module)._attn}

    class ScoreFunction(scoring.ScoreFunction):
        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            scores = torch.matmul(queries, keys.transpose(-1, -2))
            if heads.scale != 1.0:
                scores = scores / heads.scale**-1  # the forward divides by sqrt(head_dim)
            causal = self.mask(queries.shape[2], keys.shape[2], config, layer, None, scores.dtype, scores.device) == 0
            scores = torch.where(causal, scores, torch.full((), -1e4, dtype=scores.dtype, device=scores.device))
            if key_mask is not None:
                scores = scores + (1.0 - key_mask[:, None, None, :].to(scores)) * torch.finfo(scores.dtype).min
            return scores

        def sliding_window(self, config, layer):
            return None

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update):
            if sublayer == "attention":
                return stream + update
            return block.ln_2(block.ln_1(stream) + update)  # post-norm: the MLP adds to ln_1's output, then ln_2

    kind_notes = {
        "*": {
            "attention_keys": "a transposed view of the split (the forward holds [batch, heads, head_dim, seq]): "
            "in-place edits land, assignment is transposed back",
            "attention_scores": "q @ k / sqrt(head_dim), future keys replaced by -10000 (not the dtype's "
            "minimum), padded keys plus the dtype's minimum: the softmax's input",
            "attention_head_outputs": "a transposed view of _attn's (batch, heads, seq, dim) result",
            "layer_mid": "layer_input + attention_output, what ln_1 receives (post-norm: the stream continues "
            "as ln_1's output)",
            "mlp_norm_output": "ln_1(layer_mid): the MLP's input, and the stream its output is added to",
            "layer_output": "ln_2(mlp_norm_output + mlp_output): post-norm",
            "mlp_activation": "what c_proj receives (the same tensor as mlp_neurons): the activation module is "
            "one instance shared by every block, so its own output cannot name a layer",
        }
    }
