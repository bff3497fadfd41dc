"""AFMoE: a sigmoid output gate per head, per-head QK RMSNorm, rotary embedding on sliding layers only, norms before
and after each sublayer, and mixture-of-experts MLPs after `num_dense_layers` dense ones.

`gate_proj` (in the attention) gives each head a gate; the attention function's merged output is multiplied by its
sigmoid before `o_proj`: `attention_head_outputs` is the mix before the gate, `attention_gate` the sigmoid's output
viewed per head (edits land), and `head_outputs * gate`, merged, the premix. Queries and keys are RMS-normalised per
head; on sliding layers (`config.layer_types`) they are then rotated, on full layers not at all. The block adds
`post_attention_layernorm(attention_output)` to its input, normalises that with `pre_mlp_layernorm` for the MLP and
adds `post_mlp_layernorm(mlp_output)`. With `mup_enabled` the first block receives the embeddings times
`sqrt(hidden_size)`.

vLLM's AFMoE (model_executor/models/afmoe.py) multiplies the kernel's output by `torch.sigmoid(gate)` inline, as
Qwen3-Next's full-attention layers do (`qwen3_next.py`): the head outputs are the kernel's output, the gate that
sigmoid's output, the premix what `o_proj` receives, and the rebuilt pattern is read-only.
"""

from ..family import Family, VLLMLayout
from ..locations import Derived, ModuleOutput, Operation, insert_after
from ..locations.views import copy_with_batch, drop_batch, per_head, per_head_on_ranks
from ..locations.vllm import GatedPattern
from ..parts.moe import SparseMoE, moe_absent


def _afmoe_vllm_locations(family):
    locations = Family.vllm.locations(family)
    kernel = family.vllm.kernel
    heads = per_head_on_ranks(
        ModuleOutput(kernel),
        label="attention_head_outputs",
        note="what vLLM's attention kernel returns, before the output gate",
    )
    gate = per_head_on_ranks(
        Operation(("torch_sigmoid_0",), anchor="torch.sigmoid(gate)"),
        label="attention_gate",
        note="the sigmoid's output in vLLM's attention forward, per head",
    )
    embeddings = Derived(
        ModuleOutput(family.embed_tokens),
        copy_with_batch,
        drop_batch,
        in_place=False,
        note="a copy of the token embedding's output (before any muP scaling)",
        why_not="it is a copy; layers[0].layer_input is what the first block receives",
    )
    locations = {
        **locations,
        "embeddings": embeddings,
        "attention_head_outputs": heads,
        "attention_scores": GatedPattern(kernel, "scores"),
        "attention_probabilities": GatedPattern(kernel, "probabilities"),
    }
    return insert_after(locations, "attention_head_outputs", "attention_gate", gate)


NOT_ROTATED = "not rotated (full-attention layers have no positional encoding)"


class Afmoe(SparseMoE, Family):
    model_types = ("afmoe",)
    tiny = (
        "AfmoeConfig",
        "AfmoeForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "num_dense_layers": 1,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
    )
    mlp_norm = "pre_mlp_layernorm"
    attention_post_norm = "post_attention_layernorm"
    mlp_post_norm = "post_mlp_layernorm"
    absent = {**moe_absent("AfmoeExperts"), "attention_sinks": Family.absent["attention_sinks"]}
    vllm = VLLMLayout(
        model_types=("afmoe",),
        tiny={"head_dim": 32, "score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1},
        locations=_afmoe_vllm_locations,
    )
    # vLLM reads the router from the released config's fields, which transformers' config drops: transformers' router
    # is sigmoid scores, top-k renormalised, one group

    def moe_layer(self, config, layer):
        return layer >= config.num_dense_layers

    def locations(self):
        gate = per_head(Operation(("torch_sigmoid_0",), anchor="torch.sigmoid(gate_states)"), label="attention_gate")
        return insert_after(super().locations(), "attention_head_outputs", "attention_gate", gate)

    kind_notes = {
        "sliding_attention": {
            "attention_queries": "RMS-normalised per head (q_norm), then rotated",
            "attention_keys": "RMS-normalised per head (k_norm), then rotated",
        },
        "!sliding_attention": {
            "attention_queries": f"RMS-normalised per head (q_norm), {NOT_ROTATED}",
            "attention_keys": f"RMS-normalised per head (k_norm), {NOT_ROTATED}",
        },
        "*": {
            "attention_head_outputs": "the mix before the output gate: times attention_gate, merged, is the premix",
            "attention_gate": "sigmoid of gate_proj(x) per head, as the forward multiplies the merged heads by "
            "it; a view of that tensor, so edits land",
            "layer_output": "layer_mid + post_mlp_layernorm(mlp_output): a norm follows the MLP",
            "embeddings": lambda family, config, layer: (
                "the token embedding's output; layers[0].layer_input is it times sqrt(hidden_size)"
                if config.mup_enabled
                else None
            ),
        },
    }
