"""Qwen3-Next: a hybrid of gated softmax attention and Gated DeltaNet linear attention, with sparse mixture-of-experts
MLPs.

Full-attention layers (`config.layer_types[i] == "full_attention"`) are Qwen3's attention (per-head RMSNorm with a
1 + w scale on queries and keys, then a partial rotary embedding; queries and keys are read after both) with a sigmoid
output gate inside the heads: `q_proj` gives each head its query and its gate side by side, and the eager function's
output is multiplied by `torch.sigmoid(gate)` before `o_proj`. `attention_head_outputs` is that output before the
gate; `attention_gate` is the sigmoid's output, the very tensor the forward multiplies by, viewed per head, so
`head_outputs * gate` merged is the premix and edits of the gate (in place or assigned) land.

Every other layer is linear attention (`linear_attn`, a Gated DeltaNet): a recurrent state updated by a gated delta
rule, with no query-key pattern. attnlens renames `linear_attn` to `self_attn`, so `layers[i].self_attn` exists on
every layer; there it serves what the layer truly has (its output, and what its `out_proj` receives as the premix) and
reports queries, keys, values, scores, the pattern, head outputs and the gate unavailable with the reason.

Layers whose MLP is a sparse mixture of experts (all but `mlp_only_layers`, every `decoder_sparse_step`-th) have no
single activation or neuron tensor: each expert activates only its routed tokens.

On vLLM (bfloat16 only on CPU: "CPU GDN attention requires BF16") the full-attention layers multiply the kernel's
output by `torch.sigmoid(gate)` inline, as transformers does: the head outputs are the kernel's output, the gate that
sigmoid's output, the premix what `o_proj` receives. An edited pattern cannot be handed back there (attnlens's worker
recomputes head outputs at the output projection, past the gate), so the rebuilt pattern is read-only. The Gated
DeltaNet layers serve their output and what `out_proj` receives, as on eager.
"""

from __future__ import annotations

from ..family import Family, Tiny, VLLMLayout
from ..locations import Location, ModuleInput, ModuleOutput, Operation, insert_after
from ..locations.views import per_head, per_head_on_ranks
from ..locations.vllm import GatedPattern, batched
from ..parts import identities
from ..parts.mixers import LinearLayers
from ..parts.moe import PER_EXPERT, SparseMoE
from ..parts.sizes import Sizes, same_as


def _qwen3next_vllm_locations(family):
    """The full-attention layer's: head outputs are the kernel's output, then the inline sigmoid gate."""
    locations = dict(Family.vllm.locations(family))
    name, anchor = family.gate_operation
    heads = per_head_on_ranks(
        ModuleOutput(family.vllm.kernel),
        label="attention_head_outputs",
        note="what vLLM's attention kernel returns, before the output gate",
    )
    gate = per_head_on_ranks(
        Operation((name,), anchor=anchor),
        label="attention_gate",
        note="the sigmoid's output in vLLM's attention forward, per head",
    )
    for key in ("attention_scores", "attention_probabilities"):
        locations[key] = GatedPattern(locations[key].kernel, locations[key].kind)
    locations["attention_head_outputs"] = heads
    return insert_after(locations, "attention_head_outputs", "attention_gate", gate)


class Qwen3Next(LinearLayers, SparseMoE, Family):
    model_types = ("qwen3_next",)
    tiny = Tiny(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_conv_kernel_dim": 4,
            # layer 0 keeps a dense MLP so both kinds of MLP are exercised
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "mlp_only_layers": [0],
        },
    )
    #: How `support()` names the family in its reasons.
    label = "Qwen3-Next"
    mixer = linear_attention = "linear_attn"
    linear_output_projection = "out_proj"
    gate_operation = ("torch_sigmoid_0", "torch.sigmoid(gate)")
    # vLLM (model_executor/models/qwen3_next.py): the same module names; full-attention heads of 32 and up, Gated
    # DeltaNet heads of 64, bfloat16 only on CPU. Full attention with dense MLPs around a linear layer with MoE: in
    # bfloat16 a near-tied router picks another expert on each engine (measured: two experts' logits one bf16 step
    # apart), which no comparison of values absorbs; the last layer has a pattern (tests_vllm reads it).
    vllm = VLLMLayout(
        locations=_qwen3next_vllm_locations,
        model_types=("qwen3_next",),
        dtype="bfloat16",
        # bfloat16 on both engines, rounded in different orders, through a routed MoE layer: measured 3.5e-2
        # (attention_output) to 5.1e-2 (layer 1's mlp_output) apart relative across runs, past the one-step 3e-2
        tolerance=8e-2,
        tiny={
            "head_dim": 32,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "layer_types": ["full_attention", "linear_attention", "full_attention"],
            "mlp_only_layers": [0, 2],
        },
    )
    sizes = Sizes(
        num_heads=("num_v_heads", "config.num_attention_heads"),
        num_kv_heads=("num_k_heads", "config.num_key_value_heads", same_as("num_heads")),
        head_dim=("head_v_dim", "head_dim"),
        qk_head_dim=("head_k_dim", same_as("head_dim")),
        scale=("scaling", lambda module, found: module.head_k_dim**-0.5),
    )

    # --- which kind each layer is ----------------------------------------------------------------------------

    @staticmethod
    def _text(config):
        return config.get_text_config()

    def moe_layer(self, config, layer: int) -> bool:
        config = self._text(config)
        return (
            layer not in (config.mlp_only_layers or [])
            and config.num_experts > 0
            and (layer + 1) % config.decoder_sparse_step == 0
        )

    # --- where each value lives -------------------------------------------------------------------------------

    def locations(self) -> dict[str, Location]:
        """The full-attention layer's locations; the gate sits between the head outputs and the premix."""
        common = super().locations()
        name, anchor = self.gate_operation
        gate = per_head(Operation((name,), anchor=anchor), label="attention_gate")
        return insert_after(common, "attention_head_outputs", "attention_gate", gate)

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "mixer" in kind:  # the Gated DeltaNet's output projection still receives its merged heads
            premix = ModuleInput(self.linear_output_projection)
            locations["attention_premix"] = premix if engine == "transformers" else batched(premix)
        return locations

    class Identities(identities.Identities):
        def project_output(self, module, premix):
            name = (
                self.family.linear_output_projection
                if hasattr(module, self.family.linear_output_projection)
                else self.family.output_projection
            )
            return getattr(module, name)(premix)

    # --- sizes: on a linear layer, the heads its premix merges ----------------------------------------------------

    @staticmethod
    def _is_delta_net(module) -> bool:
        return hasattr(module, "num_v_heads")

    # --- what each layer lacks, and what is special -------------------------------------------------------------

    def unavailable(self, config, layer, engine="transformers"):
        reasons = super().unavailable(config, layer, engine)
        if self.is_mixer_layer(config, layer):
            kind = (
                f"layer {layer} of {self.label} is a Gated DeltaNet linear-attention layer "
                f"({self.linear_attention}): it keeps a recurrent state, updated by a gated delta rule, and forms "
                f"no query-key softmax pattern"
            )
            why = {
                "attention_queries": "; its queries, keys and values (convolved, L2-normalised inside the kernel) "
                "write and read that state instead of entering softmax attention",
                "attention_head_outputs": "; each head's readout of the state is RMS-normalised and gated by silu(z) "
                f"({self.linear_attention}.norm) before the merge, so there is no per-head "
                "mix of values; attention_premix is the merged, gated readout",
                "attention_gate": f"; its gate is silu(z) inside the gated RMSNorm ({self.linear_attention}.norm), "
                "not a sigmoid multiplying head outputs",
                "attention_sinks": "; there is no pattern whose rows a sink could shorten",
            }
            why["attention_keys"] = why["attention_values"] = why["attention_queries"]
            for name in self.mixer_lacks:
                reasons[name] = kind + why.get(name, "")
        if self.moe_layer(config, layer):
            for name in PER_EXPERT:
                reasons[name] = (
                    f"layer {layer} of {self.label} has a sparse mixture-of-experts MLP: each routed "
                    f"expert "
                    "(and the gated shared expert) applies its activation to its own tokens, so no "
                    "[batch, seq, intermediate] tensor exists; mlp_input and mlp_output are the whole "
                    "block's"
                )
        return reasons

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        text = self._text(config)
        if self.is_mixer_layer(config, layer):
            notes["attention_premix"] = (
                f"what {self.linear_attention}.out_proj receives: each of the {text.linear_num_value_heads} value "
                f"heads' readout of the recurrent state, RMS-normalised and gated by silu(z), merged; the envoy's "
                f"num_heads and head_dim are the linear value heads'"
            )
            notes["attention_output"] = f"{self.linear_attention}'s output (Gated DeltaNet, no softmax)"
            return notes
        # transformers 5.24 keeps the factor in rope_parameters; 5.19 also as an attribute
        factor = (getattr(text, "rope_parameters", None) or {}).get("partial_rotary_factor") or getattr(
            text, "partial_rotary_factor", 1.0
        )
        rotary = int(text.head_dim * factor)
        projection = "q_proj" if engine == "transformers" else "qkv_proj"  # vLLM fuses the projections
        notes["attention_queries"] = (
            f"after q_norm (RMSNorm, scale 1 + w) and a partial rotary embedding on the "
            f"first {rotary} of {text.head_dim} dims; {projection}'s other half of each "
            f"head's query is the gate"
        )
        notes["attention_keys"] = "after k_norm (RMSNorm, scale 1 + w) and the partial rotary embedding"
        notes["attention_head_outputs"] = "the mix before the output gate: times attention_gate, merged, is the premix"
        notes["attention_gate"] = (
            f"sigmoid of each head's gate half of {projection}, as the forward multiplies the "
            f"heads by it; a view of that tensor, so in-place edits land, and assignment lands "
            f"too"
        )
        return notes
