"""Zamba: Mamba layers, some of which first run a shared attention block whose output enters the Mamba layer's input.

`config.layers_block_type` names each layer `linear_attention` (a `ZambaMambaDecoderLayer`: `layer_input +
mamba(input_layernorm(layer_input))`) or `hybrid` (a `ZambaHybridLayer`). A hybrid layer runs, in order:

1. the shared attention block `shared_transf`: `input_layernorm` over `concat(layer_input, embeddings)` (twice the
   hidden size), the attention (`shared_transf.self_attn`, renamed `self_attn`: grouped heads over that doubled
   width, no positional encoding, scale `(head_dim / 2) ** -0.5`), then `pre_ff_layernorm` straight on the
   attention's output (no residual add) and the MLP (`shared_transf.feed_forward`, renamed `mlp`);
2. `linear` on the MLP's output;
3. the Mamba layer `mamba_decoder`: `layer_input + mamba(input_layernorm(layer_input + linear(mlp_output)))`.

The shared blocks are one module per hybrid layer with tied weights, so each layer's attention is addressed on its own
layer. Values served on a hybrid layer: the attention's (queries through `attention_output`, the o_proj's output),
`attention_norm_output` (the doubled-width norm output), the MLP's, `layer_input` and `layer_output`. There is no
residual stream between the attention and the MLP, so `layer_mid` is unavailable; the hybrid layer's Mamba mixer is
not served (read it with nnsight at `layers[i].mamba_decoder.mamba`). Mamba layers serve what `families/hybrid.py`
serves on a mixer layer: the mixer's output as `attention_output`, its norm's output, and the stream after it.
"""

from __future__ import annotations

from ..family import Family, Tiny, VLLMLayout
from ..locations import ModuleOutput
from ..parts import identities
from ..parts.mixers import NO_SOFTMAX
from ..parts.vllm import backend_refuses, no_dispatch

MLP_VALUES = ("mlp_norm_output", "mlp_input", "mlp_activation", "mlp_neurons", "mlp_output")
#: What a Mamba layer lacks, as `kind_reasons` open it.
MAMBA = (
    "layer {layer} of {family.label} is {family.mixer_kind} ({family.mixer}, read as self_attn), not softmax "
    "attention: it forms no queries, keys or pattern"
)


class BoundMLP:
    """A shared block's MLP bound to the layer index its forward needs (Zamba2's adapters): what the checks call."""

    def __init__(self, mlp, layer_idx: int):
        self.__dict__.update(module=mlp, layer_idx=layer_idx)

    def __call__(self, hidden_state):
        return self.module(hidden_state, self.layer_idx)

    def __getattr__(self, name):
        return getattr(self.__dict__["module"], name)


class Zamba(Family):
    model_types = ("zamba",)
    vllm = VLLMLayout(
        refusal=backend_refuses(
            "Zamba",
            no_dispatch("0 (linear_attention)"),
        )
    )
    tiny = Tiny(
        "ZambaConfig",
        "ZambaForCausalLM",
        {
            "num_hidden_layers": 5,
            "mamba_d_state": 8,
            "mamba_dt_rank": 4,
            "n_mamba_heads": 2,
            "attn_layer_period": 2,
            "attn_layer_offset": 0,
            "initializer_range": 0.1,
        },
    )
    label = "Zamba"
    final_norm = "model.final_layernorm"
    shared = "shared_transf"
    mixer = "mamba"
    mixer_kind = "a Mamba layer: a selective state-space scan over a recurrent state, convolved inputs, no heads"

    # The hybrid layers' paths (the attention's own, o_proj, are the common ones).
    attention = "shared_transf.self_attn"
    attention_norm = "shared_transf.input_layernorm"
    mlp = "shared_transf.feed_forward"
    mlp_norm = "shared_transf.pre_ff_layernorm"

    def is_hybrid(self, config, layer: int) -> bool:
        return config.layers_block_type[layer] == "hybrid"

    def renames(self, engine="transformers"):
        return {self.layers: "layers", self.attention: "self_attn", self.mlp: "mlp", self.mixer: "self_attn"}

    def layer_kind(self, config, layer):
        return frozenset({"hybrid" if self.is_hybrid(config, layer) else "mixer"})

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "hybrid" in kind:
            return {name: location for name, location in locations.items() if name != "layer_mid"}
        mixer_layer = {
            "attention_norm_output": ModuleOutput("input_layernorm"),
            "attention_output": ModuleOutput(""),  # the mixer returns one tensor
            "layer_mid": ModuleOutput("", 0),  # the stream after the mixer leaves the block: no MLP follows
        }
        dropped = (*NO_SOFTMAX, *MLP_VALUES)
        return {name: mixer_layer.get(name, location) for name, location in locations.items() if name not in dropped}

    class Identities(identities.Identities):
        def mlp_module(self, block):
            shared = getattr(block, self.family.shared, None)
            return None if shared is None else shared.feed_forward

        def residual_add(self, block, sublayer, stream, update):
            """On a hybrid layer the attention adds nothing to the stream itself (its output feeds the shared block's
            MLP), and the MLP's output reaches it through `linear` and the Mamba layer: the stream after the MLP is
            `mamba_decoder(stream, transformer_hidden_states=linear(update))`, the hybrid layer's output."""
            if getattr(block, self.family.shared, None) is None:
                return stream + update
            if sublayer == "attention":
                return stream
            return block.mamba_decoder(stream, transformer_hidden_states=block.linear(update))

    kind_reasons = {
        "hybrid": {
            "layer_mid": "layer {layer} of {family.label} runs the shared attention block, then a Mamba layer: the "
            "attention output enters the block's pre_ff_layernorm with no residual add (the block reads "
            "concat(layer_input, embeddings) and returns its MLP's output, which `linear` projects and adds to the "
            "Mamba layer's input, not to the stream), so no residual stream lies between attention and the MLP",
        },
        "mixer": {
            **dict.fromkeys(NO_SOFTMAX, MAMBA),
            "attention_head_outputs": f"{MAMBA}, so no head mixes values by a pattern",
            "attention_premix": f"{MAMBA}; what its out_proj receives is the gated scan output, not attention heads "
            "merged",
            **dict.fromkeys(
                MLP_VALUES,
                "layer {layer} of {family.label} is a Mamba layer, which has no MLP (the MLPs are in the shared "
                "attention blocks of the hybrid layers)",
            ),
        },
    }

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if not self.is_hybrid(config, layer):
            notes = {name: note for name, note in notes.items() if not name.startswith("attention_")}
            notes["attention_output"] = f"{self.mixer}'s output: {self.mixer_kind}"
            notes["layer_mid"] = "the block's output: a Mamba layer runs only its mixer, no MLP"
            return notes
        shared = self.shared_note(config, layer)
        notes["attention_norm_output"] = (
            f"{self.shared}.input_layernorm over concat(layer_input, embeddings): [batch, seq, 2 * hidden]"
        )
        if not getattr(config, "use_mem_rope", False):
            notes["attention_queries"] = notes["attention_keys"] = "no positional encoding: nothing is rotated"
        notes["attention_output"] = (
            f"the shared attention's o_proj output{shared}; it joins no residual stream itself: pre_ff_layernorm reads "
            f"it directly. The hybrid layer's Mamba mixer is not served: read it with nnsight at "
            f"layers[{layer}].mamba_decoder.mamba"
        )
        notes["mlp_norm_output"] = "pre_ff_layernorm(attention_output): no residual is added before it"
        notes["mlp_output"] = (
            f"the shared block's output; layer_output = layer_input + mamba(input_layernorm("
            f"layer_input + linear(mlp_output))), through layers[{layer}].mamba_decoder"
        )
        return notes

    def shared_note(self, config, layer) -> str:
        hybrid = [i for i, kind in enumerate(config.layers_block_type) if kind == "hybrid"]
        return f" (one weight set tied across the hybrid layers {hybrid})"
