"""Zamba2: Zamba's layout (`families/zamba.py`) with Mamba-2 layers, `num_mem_blocks` shared blocks used in turn,
per-layer adapters, and optionally a rotary embedding.

The hybrid layers' shared blocks (`shared_transformer`, one module per hybrid layer) are tied in a cycle of
`num_mem_blocks` weight sets. Where `use_shared_attention_adapter`, each hybrid layer adds its own low-rank adapter's
output to q_proj's, k_proj's and v_proj's (selected by the layer index the block is called with), so the queries, keys
and values are the adapted ones; the MLP (`feed_forward`, renamed `mlp`) always adds its layer's adapter to
`gate_up_proj` and takes the layer index as a second argument. Where `use_mem_rope`, the queries and keys are
rotated before they enter attention.

`StandardizedVLLM` refuses the family (`vllm.refusal`): vLLM's Zamba2 builds one shared block per weight set, called
by every hybrid layer tied to it.
"""

from dataclasses import replace

from ..family import MLPArithmetic, Tiny
from ..parts import identities
from .zamba import BoundMLP, Zamba


class Zamba2(Zamba):
    model_types = ("zamba2",)
    tiny = Tiny(
        "Zamba2Config",
        "Zamba2ForCausalLM",
        {
            "num_hidden_layers": 5,
            "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid", "hybrid"],
            # the adapters' outputs are attention_hidden_size wide: as many kv heads as heads
            "num_key_value_heads": None,
            "mamba_d_state": 8,
            "n_mamba_heads": 4,
            "num_mem_blocks": 2,
            "use_shared_attention_adapter": True,
            "adapter_rank": 8,
            "use_mem_rope": True,
            "initializer_range": 0.1,
        },
        layouts={"plain": {"use_shared_attention_adapter": False, "use_mem_rope": False, "num_key_value_heads": 2}},
    )
    label = "Zamba2"
    vllm = replace(
        Zamba.vllm,
        refusal="vLLM's Zamba2 (model_executor/models/zamba2.py) builds one shared transformer module per weight "
        "set (num_mem_blocks of them) and calls it from every hybrid layer tied to it, with the layer's "
        "index choosing its adapters and kernel (dpa_list[block_idx]), so one module's input and output "
        "hold several layers' values in one forward; attnlens reads a module once per layer",
    )
    shared = "shared_transformer"
    attention = "shared_transformer.self_attn"
    attention_norm = "shared_transformer.input_layernorm"
    mlp = "shared_transformer.feed_forward"
    mlp_norm = "shared_transformer.pre_ff_layernorm"
    mixer_kind = (
        "a Mamba-2 layer: a selective state-space scan over a recurrent state, gated and RMS-normalised before out_proj"
    )

    class Identities(identities.Identities):
        def mlp_module(self, block):
            shared = getattr(block, self.family.shared, None)
            return None if shared is None else BoundMLP(shared.feed_forward, block.mamba_decoder.layer_idx)

        def mlp_arithmetic(self, mlp):
            # Zamba2MLP.forward: the layer's untied adapter is added to the fused projection before the halves split
            def halves(x):
                return (mlp.gate_up_proj(x) + mlp.gate_up_proj_adapter_list[mlp.layer_dic[mlp.layer_idx]](x)).chunk(
                    2, -1
                )

            return MLPArithmetic(
                mlp.down_proj,
                lambda x: halves(x)[0],
                mlp.act_fn,
                lambda x, activation: activation * halves(x)[1],
                says=(
                    "gate half of (gate_up_proj + adapter)(mlp input)",
                    "activation * up half of (gate_up_proj + adapter)(mlp input)",
                    "down projection(neurons)",
                ),
            )

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if not self.is_hybrid(config, layer):
            return notes
        if config.use_shared_attention_adapter:
            for name in ("attention_queries", "attention_keys", "attention_values"):
                projection = name.split("_")[1][0]
                notes[name] = (
                    f"{projection}_proj's output plus this layer's own adapter "
                    f"(linear_{projection}_adapter_list), untied"
                )
        if config.use_mem_rope:
            for name in ("attention_queries", "attention_keys"):
                notes[name] = "; ".join(filter(None, (notes.get(name), "then rotated")))
        notes["mlp_neurons"] = "act(gate) * up, where gate_up_proj's output has this layer's own adapter added"
        return notes

    def shared_note(self, config, layer):
        hybrid = config.hybrid_layer_ids
        tied = [
            i for n, i in enumerate(hybrid) if n % config.num_mem_blocks == hybrid.index(layer) % config.num_mem_blocks
        ]
        return f" (one weight set tied across the hybrid layers {tied}, {config.num_mem_blocks} sets in turn)"
