"""GPT-J: a parallel block (attention and the MLP both read `ln_1`'s output), partial interleaved rotary embedding,
and scores computed in float32 whatever the model's dtype.

The rotary embedding rotates adjacent pairs (`rotate_every_two`) over the first `rotary_dim` dimensions of each head;
queries and keys are read after it. The attention function upcasts queries and keys to float32 before `q @ k^T`, so
the scores are float32 (plus the mask, built in the model's dtype) and the pattern is cast back to the values' dtype.
Because attention and the MLP read one `ln_1` output and the block adds both outputs to its input at once,
`layer_mid` is unavailable and `mlp_norm_output` is that norm output as the MLP receives it.

transformers 5.19 runs its own `_attn` method (scores divided by `sqrt(head_dim)`, head outputs returned per head
before the transpose, no sdpa path); 5.20 and later call the shared attention interface with a file-local eager
function (scores multiplied by `head_dim ** -0.5`). The family reads whichever the installed transformers has.
"""

import torch

from ..family import Family, Tiny, VLLMLayout
from ..locations import Derived, ModuleInput, Operation
from ..parts import scoring
from ..parts.mirrored import mirrored
from ..parts.parallel import PARALLEL_NO_MID, parallel_locations, shared_attention_norm
from ..parts.sizes import Sizes
from ..parts.source import transformers_defines

OWN_ATTN = "self__attn_0"  # transformers <= 5.19: GPTJAttention._attn


def _heads_last(envoy, per_head):
    return per_head.transpose(1, 2)  # [batch, heads, seq, dim] -> [batch, seq, heads, dim], a view of the same storage


def _gptj_vllm_locations(family):
    from ..locations import ModuleArgument
    from ..locations.vllm import batched

    # vLLM's block is called as layer(positions, hidden_states)
    return {**mirrored(family, family.locations(), own_port=True), "layer_input": batched(ModuleArgument("", 1))}


class GPTJ(Family):
    model_types = ("gptj",)
    tiny = Tiny(
        "GPTJConfig",
        "GPTJForCausalLM",
        {
            "n_layer": 3,
            "n_embd": 64,
            "n_head": 4,
            "n_inner": 128,
            "rotary_dim": 8,
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
    embed_tokens = "transformer.wte"
    final_norm = "transformer.ln_f"
    attention = "attn"
    attention_norm = "ln_1"
    output_projection = "out_proj"
    activation = "act"
    down_projection = "fc_out"
    absent = {"layer_mid": PARALLEL_NO_MID.format(norms="one shared ln_1")}
    #: The attention class (module under transformers.models, class): its `_attn` method, where it has one
    #: (transformers <= 5.19), runs instead of the attention interface.
    attention_class = ("gptj.modeling_gptj", "GPTJAttention")
    #: The assignment in `_attn` holding the masked scores, and the line it must be on.
    own_scores = ("attn_weights_2", "+ attention_mask")

    def own_attn(self) -> bool:
        return transformers_defines(*self.attention_class, "_attn")

    vllm = VLLMLayout(
        locations=_gptj_vllm_locations,
        model_types=("gptj",),  # vLLM's own GPTJForCausalLM
        tiny={"n_embd": 128},  # head size 32
    )
    sizes = Sizes(
        num_heads=("num_attention_heads",),
        num_kv_heads=("num_attention_heads",),
        scale=(lambda module, found: 1 / module.scale_attn, "scaling"),
    )

    def locations(self):
        locations = parallel_locations(super().locations(), ModuleInput(self.mlp))
        if self.own_attn():
            locations.update(
                {
                    "attention_queries": Operation((OWN_ATTN,), "arg", 0),
                    "attention_keys": Operation((OWN_ATTN,), "arg", 1),
                    "attention_values": Operation((OWN_ATTN,), "arg", 2),
                    "attention_scores": Operation((OWN_ATTN, self.own_scores[0]), anchor=self.own_scores[1]),
                    "attention_probabilities": Operation((OWN_ATTN, "attn_weights_5"), anchor="attn_dropout("),
                    "attention_head_outputs": Derived(
                        Operation((OWN_ATTN,), "output", 0),
                        _heads_last,
                        lambda envoy, old, new: new.transpose(1, 2),
                        "attention_head_outputs (GPT-J's _attn returns heads first)",
                    ),
                }
            )
        return locations

    def drilled_functions(self, attention_module):
        if self.own_attn():
            return {OWN_ATTN: type(attention_module)._attn}
        return super().drilled_functions(attention_module)

    class ScoreFunction(scoring.ScoreFunction):
        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            scores = torch.matmul(queries.float(), keys.float().transpose(2, 3))
            # 5.19 divides by sqrt(head_dim), later versions multiply by its inverse: not always the same float
            scores = scores * heads.scale
            # the mask is built in the model's dtype and added to the float32 scores
            return scores + self.mask(
                queries.shape[2], keys.shape[2], config, layer, key_mask, queries.dtype, queries.device
            )

    kind_notes = {
        "*": {
            "mlp_norm_output": shared_attention_norm,
            "attention_scores": "float32 whatever the model's dtype: queries and keys are upcast before "
            "q @ k^T; masked entries are the score plus the model dtype's minimum",
        },
        "transformers": {
            "attention_head_outputs": lambda family, config, layer: (
                "transposed from _attn's (batch, heads, seq, dim) output: a view, so in-place edits land; assignment "
                "is transposed back"
                if family.own_attn()
                else None
            ),
        },
    }
