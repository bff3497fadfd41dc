"""OPT: queries scaled before attention, learned positions, and an MLP the block runs itself on flattened tokens.

OPTAttention multiplies the query projection by `head_dim ** -0.5` (bias included) and calls the attention function
with `scaling=1.0`: `attention_queries` are those pre-scaled queries, the scores are `queries @ keys^T` with no
further factor, and `attn.scale` is 1.0.

The block has no MLP module: it flattens the residual to [batch * seq, hidden] and calls `final_layer_norm`, `fc1`,
`activation_fn` and `fc2` itself. `layers[i].mlp` is `fc2` (the MLP's last step; its input is the activation's output,
its output the MLP's), and every value read on the flattened tokens is viewed back as [batch, seq, ...]: a view of the
same storage, so in-place edits land, and assignments are flattened back. `layer_mid` is what `final_layer_norm`
receives (the residual after attention, flattened). When nnsight batches several invokes, each invoke's rows are cut
out of the flattened tokens (and spliced back on assignment).

With `do_layer_norm_before=False` (OPT-350m) the norms follow the sublayers instead of preceding them; attnlens
serves the attention values and the block's input and output there, and reports the norm-placed values unavailable.

vLLM's OPT holds tokens flat and fuses the projections into `qkv_proj`; its kernel receives the queries unscaled and
scales them itself, so on vLLM `attention_queries` are not pre-scaled and `attn.scale` is `head_dim ** -0.5`
(`VLLM_QUERIES`): each engine's queries and scale give the same scores.
"""

from ..family import Family, Tiny, VLLMLayout
from ..locations import Derived, ModuleInput, ModuleOutput
from ..parts import identities
from ..parts.mirrored import mirrored
from ..parts.sizes import Sizes

FLAT = (
    "read on the block's flattened tokens (batch * seq rows) and viewed back as batch, seq, ... (a view: "
    "in-place edits land)"
)
VLLM_QUERIES = (
    "not pre-scaled: vLLM's kernel receives q_proj(x) and applies head_dim ** -0.5 itself, so attn.scale "
    "is that factor here, where on eager the queries carry it and attn.scale is 1.0: these are the "
    "transformers engine's attention_queries divided by head_dim ** -0.5, and queries @ keys^T * "
    "attn.scale are the same scores on both engines"
)
POST_NORM = (
    "OPT with do_layer_norm_before=False normalises after each sublayer, not before it: {what}; attnlens does "
    "not serve it on this layout"
)


def _rows():
    """(the combined batch size, this invoke's [start, size] rows when nnsight batches several invokes, else None)."""
    from ..locations import mediator

    running = mediator()
    batcher = running.interleaver.batcher
    return batcher.total, (running.batch_group if batcher.batching else None)


def _unflatten(envoy, flat):
    total, group = _rows()
    if group is not None and flat.shape[0] == group[1]:  # one token per row: nnsight already narrowed it
        return flat.view(group[1], 1, -1)
    tokens = flat.view(total, -1, flat.shape[-1])
    return tokens if group is None else tokens[group[0] : group[0] + group[1]]


def _flatten(envoy, old, new):
    total, group = _rows()
    if group is None or old.shape[0] == group[1]:
        return new.reshape(old.shape)
    tokens = old.view(total, -1, old.shape[-1]).clone()
    tokens[group[0] : group[0] + group[1]] = new
    return tokens.view(old.shape)


def _flat(source, label):
    return Derived(source, _unflatten, _flatten, label)


def _opt_vllm_locations(family):
    # vLLM's block holds tokens flat already: the eager values' sources, with a batch axis
    return mirrored(
        family,
        {
            name: location.source if isinstance(location, Derived) else location
            for name, location in family.locations().items()
        },
        own_port=True,
    )


class OPT(Family):
    model_types = ("opt",)
    tiny = Tiny(
        "OPTConfig",
        "OPTForCausalLM",
        {"ffn_dim": 128, "word_embed_proj_dim": 64, "num_key_value_heads": None, "intermediate_size": None},
    )
    layers = "model.decoder.layers"
    embed_tokens = "model.decoder.embed_tokens"
    final_norm = "model.decoder.final_layer_norm"
    attention_norm = "self_attn_layer_norm"
    mlp_norm = "final_layer_norm"
    output_projection = "out_proj"
    mlp = "fc2"  # no MLP module: its last step carries the MLP's values (renamed `mlp`)
    activation = "activation_fn"
    down_projection = "fc2"  # on the block, which runs the MLP (see `mlp_module`)
    vllm = VLLMLayout(
        locations=_opt_vllm_locations,
        model_types=("opt",),  # vLLM's own OPTForCausalLM
        tiny={"hidden_size": 128, "word_embed_proj_dim": 128},  # head size 32
    )
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=("num_heads",), scale=(1.0,))

    def locations(self):
        locations = super().locations()
        locations.update(
            {
                "layer_mid": _flat(ModuleInput(self.mlp_norm), "layer_mid"),
                "mlp_norm_output": _flat(ModuleOutput(self.mlp_norm), "mlp_norm_output"),
                "mlp_input": _flat(ModuleInput("fc1"), "mlp_input"),
                "mlp_activation": _flat(ModuleInput(), "mlp_activation"),  # fc2 receives the activation's output itself
                "mlp_neurons": _flat(ModuleInput(), "mlp_neurons"),
                "mlp_output": _flat(ModuleOutput(), "mlp_output"),
            }
        )
        return locations

    class Identities(identities.Identities):
        def mlp_module(self, block):
            return block  # the block calls fc1, activation_fn and fc2 itself

        def mlp_forward(self, block, mlp_input):
            return block.fc2(block.activation_fn(block.fc1(mlp_input)))

    def unavailable(self, config, layer, engine="transformers"):
        reasons = super().unavailable(config, layer, engine)
        if not config.do_layer_norm_before:
            reasons.update(
                {
                    "attention_norm_output": POST_NORM.format(what="attention reads the block input itself"),
                    "layer_mid": POST_NORM.format(
                        what="the residual entering the MLP is self_attn_layer_norm(layer_input "
                        "+ attention_output), and no norm precedes the MLP"
                    ),
                    "mlp_norm_output": POST_NORM.format(what="no norm precedes the MLP (final_layer_norm follows it)"),
                    "final_norm_output": POST_NORM.format(
                        what="the decoder has no final norm, each block ends in its own"
                    ),
                }
            )
        return reasons

    def notes(self, config, layer, engine="transformers"):
        if engine == "vllm":
            return {
                **super().notes(config, layer, engine),
                "attention_queries": VLLM_QUERIES,
                "attention_scores": "queries @ keys^T * head_dim ** -0.5 (attn.scale), masked: eager's scores",
            }
        notes = dict.fromkeys(
            ("layer_mid", "mlp_norm_output", "mlp_input", "mlp_activation", "mlp_neurons", "mlp_output"), FLAT
        )
        notes.update(
            {
                "attention_queries": "pre-scaled: q_proj(x) * head_dim ** -0.5, bias included (attn.scale is 1.0)",
                "attention_scores": "queries @ keys^T with no further factor (the queries carry head_dim ** -0.5), "
                "masked",
                "mlp_activation": "activation_fn's output, read as what fc2 receives (the same tensor); " + FLAT,
                "mlp_neurons": "what fc2 receives, equal to mlp_activation (no gate); " + FLAT,
            }
        )
        return {**super().notes(config, layer, engine), **notes}
