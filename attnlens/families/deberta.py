"""DeBERTa and DeBERTa-v2 (v3's checkpoints are DeBERTa-v2): BERT's post-norm encoder block around an attention of
their own, disentangled: the scores add to the content's `q . k` a content-to-position term (each query against the
relative position of each key, `c2p`) and a position-to-content term (each key against the relative position of each
query, `p2c`), as `config.pos_att_type` says, all divided by `sqrt(head_dim * (1 + number of terms))`. Masked
language models only: transformers has no causal LM for either type.

The block is BERT's (`bert.py`: `attention` renamed `self_attn`, `output` renamed `mlp`, a LayerNorm after each
residual add); the attention's arithmetic is written in its `self` module (`DisentangledSelfAttention`), not through
the attention interface:

- DeBERTa: one fused projection `in_proj` laid out per head (`[q | k | v]`), chunked; `q_bias` and `v_bias` added
  after; the queries divided by the scale before `q @ k^T`. The relative terms (`disentangled_att_bias`) read the
  relative embeddings of the encoder (`rel_embeddings`, `2 * max_relative_positions` rows: the rows around the middle
  that the prompt's distances reach), projected per layer (`pos_proj` for c2p, `pos_q_proj` for p2c).
- DeBERTa-v2: three projections; heads folded into the batch (`[batch * heads, seq, head_dim]`: the values are views
  of those tensors as `[batch, heads, ...]`, true views); the keys divided by the scale. Distances may be bucketed
  (`position_buckets`: exact up to half the buckets, logarithmic beyond, up to `max_relative_positions`); the relative
  embeddings may be normalised (`norm_rel_ebd="layer_norm"`) and projected by the content's own projections
  (`share_att_key`: `key_proj` for c2p, `query_proj` for p2c) or by projections of their own.

The relative terms, c2p + p2c already divided by the scale, are `attention_position_bias` (the output of the call
that computes them, `[batch, heads, query, key]`; editable: what the scores add). The mask is DeBERTa's: a padded
key is masked for every query, and a padded query's whole row is masked (a uniform row over every key).

Not served: DeBERTa's talking heads (`talking_head`, a mix of the heads' scores before the softmax and of the pattern
after it) leave the scores and the pattern unserved; DeBERTa-v2's convolution after the first block
(`conv_kernel_size > 0`) leaves that block's `layer_output` unserved (what enters layers[1] is the convolution's
output).
"""

from __future__ import annotations

import torch

from ..family import EagerFunction, Tiny
from ..locations import Derived, ModuleInput, ModuleOutput, Operation, OutputField, softmax_argument
from ..parts import scoring
from ..parts.sizes import Sizes
from ..parts.vllm import encoder_on_vllm
from .bert import Bert

BIAS = "DeBERTa's disentangled relative terms (attention_position_bias): content-to-position and position-to-content"

TALKING_HEADS = (
    "with talking_head, DeBERTa mixes the heads' scores before the softmax (head_logits_proj) and the pattern after "
    "it (head_weights_proj): attnlens does not serve those mixes as scores and a pattern"
)
CONV = (
    "DeBERTa-v2's encoder passes layers[0]'s output through its convolution (conv_kernel_size: a 1-d convolution of "
    "the embeddings, added to the block's output and normalised) before layers[1]; attnlens reads neither the "
    "block's own output as the stream nor the convolution: layers[1].layer_input is the stream after it"
)
NO_TERMS = (
    "no relative terms: this config has {why}, so the scores are the queries' products with the keys (scaled, "
    "masked), and positions enter only through the embeddings"
)


def terms(config) -> list[str]:
    """The relative terms `config` computes: "c2p" and "p2c" where named in `pos_att_type` and relative attention
    is on; none otherwise."""
    if not getattr(config, "relative_attention", False):
        return []
    return [term for term in ("c2p", "p2c") if term in (config.pos_att_type or [])]


def _no_terms(family, config, layer):
    why = (
        "relative_attention=False"
        if not getattr(config, "relative_attention", False)
        else "no c2p or p2c in pos_att_type"
    )
    return NO_TERMS.format(why=why)


def divisor(head_dim: int, factor: int) -> torch.Tensor:
    """What DeBERTa divides its scores by: `sqrt(head_dim * factor)`, in float32 as it computes it."""
    return torch.sqrt(torch.tensor(head_dim, dtype=torch.float) * factor)


def counted(kinds) -> int:
    """DeBERTa's scale factor: 1 + every entry of `pos_att_type`."""
    return 1 + len(kinds)


def counted_v2(kinds) -> int:
    """DeBERTa-v2's scale factor: 1 + "c2p" and "p2c" where `pos_att_type` names them."""
    return 1 + sum(term in kinds for term in ("c2p", "p2c"))


def _pattern_of(envoy):
    return getattr(envoy._module, "self", envoy._module)  # the attention's `self` (DisentangledSelfAttention)


def _unfold(envoy, folded):
    """DeBERTa-v2's [batch * heads, ...] -> [batch, heads, ...], a view."""
    heads = _pattern_of(envoy).num_attention_heads
    return folded.view(folded.shape[0] // heads, heads, *folded.shape[1:])


def _fold(envoy, old, new):
    return new.reshape(old.shape)


class Deberta(Bert):
    """DeBERTa: BERT's block around disentangled attention, one fused projection, the queries scaled."""

    model_types = ("deberta",)
    tiny = Tiny(
        "DebertaConfig",
        "DebertaForMaskedLM",
        {"num_key_value_heads": None, "relative_attention": True, "pos_att_type": ["c2p", "p2c"]},
        layouts={
            "absolute": {"relative_attention": False, "pos_att_type": None},  # the config class's defaults
            "c2p": {"pos_att_type": ["c2p"]},
            "short_span": {"max_relative_positions": 3},  # distances beyond 3 clamped to the last row
        },
    )
    vllm = encoder_on_vllm("DeBERTa")
    layers = "deberta.encoder.layer"
    embed_tokens = "deberta.embeddings.word_embeddings"
    eager = EagerFunction(only=())  # one attention path, whatever attn_implementation says
    fused_views = ("attention_keys",)
    padding_changes_values = (
        "with position_biased_input (the config's default), absolute positions count from the padded start"
    )
    #: Which side DeBERTa divides by the scale before the product: the queries (DeBERTa) or the keys (DeBERTa-v2).
    divides: str = "queries"
    sizes = Sizes(
        num_heads=("self.num_attention_heads",),
        head_dim=("self.attention_head_size",),
        scale=(lambda module, found: 1 / divisor(found["head_dim"], counted(module.self.pos_att_type)).item(),),
    )
    #: 1 + the relative terms the scale counts, from `pos_att_type`: every entry on DeBERTa (whether or not
    #: relative attention is on).
    factor = staticmethod(counted)

    def layer_kind(self, config, layer):
        kind = {"relative"} if terms(config) else set()
        if getattr(config, "talking_head", False):
            kind.add("talking_head")
        return frozenset(kind)

    def kind_locations(self, kind, config, engine):
        found = dict(self.locations())
        if "relative" not in kind:
            found.pop("attention_position_bias")
        if "talking_head" in kind:
            found.pop("attention_scores")
            found.pop("attention_probabilities")
        return found

    def attention_values(self) -> dict:
        """Where the attention's values live in `self`'s forward."""
        inner = dict(module="self")
        return {  # the keys first: chunked out of the fused projection before the queries get their bias
            "attention_keys": Operation(("chunk_0",), item=1, anchor=".chunk(3", **inner),
            "attention_queries": Operation(("query_layer_0",), anchor="self.q_bias", **inner),
            "attention_values": Operation(("value_layer_0",), anchor="self.v_bias", **inner),
            "attention_position_bias": Operation(
                ("self_disentangled_att_bias_0",), anchor="self.disentangled_att_bias(", **inner
            ),
            "attention_scores": softmax_argument(**inner),
            "attention_probabilities": Operation(("attention_probs_1",), anchor="self.dropout(", **inner),
            "attention_head_outputs": Operation(("context_layer_1",), anchor="permute(0, 2, 1, 3)", **inner),
        }

    def locations(self):
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            **self.attention_values(),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput(self.output_projection),
            "layer_mid": ModuleInput(self.mlp_norm),
            "mlp_norm_output": ModuleOutput(self.mlp_norm),
            "mlp_input": ModuleInput("intermediate"),
            "mlp_activation": ModuleInput(),
            "mlp_neurons": ModuleInput(self.down_projection),
            "mlp_output": ModuleOutput(self.down_projection),
            "layer_output": ModuleOutput("", 0),  # DebertaLayer returns (output, pattern or None)
            "logits": OutputField("logits"),
        }

    class ScoreFunction(scoring.Bidirectional):
        def sliding_window(self, config, layer):
            return None

        def score_bias(self, config, layer):
            return BIAS if terms(config) else None

        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            """`q . k` divided by `sqrt(head_dim * (1 + len(pos_att_type)))` on the side the family divides, masked
            with the dtype's minimum (not added: DeBERTa fills); the relative terms are the score bias."""
            scale = divisor(queries.shape[-1], self.family.factor(config.pos_att_type or [])).to(queries.dtype)
            if self.family.divides == "queries":
                scores = torch.matmul(queries / scale, keys.transpose(-1, -2))
            else:
                scores = torch.matmul(queries, keys.transpose(-1, -2) / scale)
            mask = self.mask(queries.shape[2], keys.shape[2], config, layer, key_mask, scores.dtype, scores.device)
            return scores.masked_fill(mask != 0, torch.finfo(scores.dtype).min)

        def mask(self, num_queries, num_keys, config, layer, key_mask=None, dtype=torch.float32, device=None):
            """Padding masked both ways: a padded key for every query, and a padded query's whole row."""
            mask = super().mask(num_queries, num_keys, config, layer, key_mask, dtype, device)
            if key_mask is None:
                return mask
            queries = key_mask[:, None, num_keys - num_queries :, None].bool().to(mask.device)
            return mask.masked_fill(~queries, torch.finfo(dtype).min)

    class Identities(Bert.Identities):
        def score_bias_value(self, module, values, layer):
            return values["attention_position_bias"]

        def layer_position_bias(self, root, module, values, num_queries, num_keys):
            encoder = root.get_submodule(self.family.layers.rpartition(".")[0])
            return self.family.relative_terms(
                module.self,
                self.family.relative_embeddings(encoder),
                values["attention_queries"],
                values["attention_keys"],
            )

    def relative_embeddings(self, encoder) -> torch.Tensor:
        """The relative embeddings the encoder hands every layer."""
        return encoder.rel_embeddings.weight

    def relative_terms(self, attention, embeddings, queries, keys) -> torch.Tensor:
        """c2p + p2c, `[batch, heads, query, key]`, recomputed from the attention's projections (`attention`: its
        `self`), the encoder's relative embeddings and the layer's queries and keys (`[batch, heads, seq, head_dim]`,
        as served): for query i and key j at distance `d = clamp(i - j + span, 0, 2 span - 1)`, `q_i . pos_key[d] / s`
        plus `k_j . pos_query[d] / s`, where `span = min(seq, max_relative_positions)` and the embeddings' rows are the
        `2 span` around the middle."""
        largest = attention.max_relative_positions
        span = min(max(queries.shape[2], keys.shape[2]), largest)
        rows = embeddings[largest - span : largest + span]
        s = divisor(queries.shape[-1], self.factor(attention.pos_att_type)).to(queries.dtype)
        distance = _distances(queries.shape[2], keys.shape[2], span, queries.device)
        bias = 0
        if "c2p" in attention.pos_att_type:
            bias = bias + _gathered(queries / s, _per_head(attention.pos_proj(rows), attention), distance)
        if "p2c" in attention.pos_att_type:
            position_queries = _per_head(attention.pos_q_proj(rows), attention) / s
            bias = bias + _gathered(keys, position_queries, distance.T).transpose(-1, -2)
        return bias

    kind_reasons = {
        "!relative": {"attention_position_bias": _no_terms},
        "talking_head": dict.fromkeys(("attention_scores", "attention_probabilities"), TALKING_HEADS),
    }
    kind_notes = {
        "*": {
            "attention_queries": "in_proj's query slice + q_bias, before DeBERTa divides it by "
            "sqrt(head_dim * (1 + len(pos_att_type))) (the scale)",
            "attention_keys": "in_proj's key slice (no bias); a view of the fused projection: assign it, in-place "
            "edits fail",
            "attention_values": "in_proj's value slice + v_bias",
            "attention_scores": lambda family, config, layer: (
                "(queries / sqrt(head_dim * (1 + len(pos_att_type)))) @ keys^T"
                + (" + attention_position_bias" if terms(config) else "")
                + "; padded keys and padded queries' rows filled with the dtype's minimum"
            ),
            "attention_probabilities": "bidirectional: every query sees every key that is not padding (a padded "
            "query's row is uniform)",
            "attention_position_bias": lambda family, config, layer: (
                f"[batch, num_heads, query, key]: {' + '.join(terms(config))} (pos_att_type), already divided by "
                "the scale as the scores are; computed in every layer from its own queries and keys and the "
                "encoder's relative embeddings (rel_embeddings), projected by the layer; assigning it moves the scores"
            ),
            "attention_output": "attention.output.dense's output (its dropout, the identity in eval, follows)",
            "layer_input": lambda family, config, layer: (
                "LayerNorm of the word embeddings (+ absolute positions with position_biased_input, + token types "
                "where type_vocab_size > 0), times the attention mask: the embeddings module's output"
                if layer == 0
                else None
            ),
        }
    }


class DebertaV2(Deberta):
    """DeBERTa-v2 (and v3's checkpoints): three projections, heads folded into the batch, the keys scaled, distances
    bucketed, relative embeddings normalised and projected by the content projections where the config says so."""

    model_types = ("deberta-v2",)
    tiny = Tiny(
        "DebertaV2Config",
        "DebertaV2ForMaskedLM",
        {
            "num_key_value_heads": None,
            "relative_attention": True,
            "pos_att_type": ["c2p", "p2c"],
            # DeBERTa-v3's arrangement, its 256 buckets made 8: distances beyond 4 in logarithmic buckets
            "position_buckets": 8,
            "share_att_key": True,
            "norm_rel_ebd": "layer_norm",
        },
        layouts={
            "absolute": {"relative_attention": False, "pos_att_type": None},  # the config class's defaults
            "own_projections": {"share_att_key": False, "norm_rel_ebd": "none"},
            "unbucketed": {"position_buckets": -1, "max_relative_positions": 6},
            "p2c": {"pos_att_type": ["p2c"]},
        },
    )
    vllm = encoder_on_vllm("DeBERTa-v2")
    fused_views = ()
    divides = "keys"
    sizes = Sizes(
        num_heads=("self.num_attention_heads",),
        head_dim=("self.attention_head_size",),
        scale=(lambda module, found: 1 / divisor(found["head_dim"], counted_v2(module.self.pos_att_type)).item(),),
    )
    factor = staticmethod(counted_v2)  # only "c2p" and "p2c" count

    def layer_kind(self, config, layer):
        kind = {"relative"} if terms(config) else set()  # (no talking heads: DeBERTa-v2's attention has none)
        if layer == 0 and getattr(config, "conv_kernel_size", 0) > 0:
            kind.add("conv")
        return frozenset(kind)

    def kind_locations(self, kind, config, engine):
        found = super().kind_locations(kind, config, engine)
        if "conv" in kind:
            found.pop("layer_output")
        return found

    def attention_values(self):
        inner = dict(module="self")

        def unfolded(name, operation, anchor):
            return Derived(Operation((operation,), anchor=anchor, **inner), _unfold, _fold, name)

        return {
            "attention_queries": unfolded("attention_queries", "query_layer_0", "self.query_proj("),
            "attention_keys": unfolded("attention_keys", "key_layer_0", "self.key_proj("),
            "attention_values": unfolded("attention_values", "value_layer_0", "self.value_proj("),
            "attention_position_bias": unfolded(
                "attention_position_bias", "self_disentangled_attention_bias_0", "self.disentangled_attention_bias("
            ),
            "attention_scores": softmax_argument(**inner),
            "attention_probabilities": Operation(("attention_probs_1",), anchor="self.dropout(", **inner),
            "attention_head_outputs": Operation(("context_layer_1",), anchor="context_layer = (", **inner),
        }

    def relative_embeddings(self, encoder):
        return encoder.get_rel_embedding()  # normalised where norm_rel_ebd says layer_norm

    def relative_terms(self, attention, embeddings, queries, keys):
        """c2p + p2c as DeBERTa-v2 computes them: distances bucketed where `position_buckets > 0` (`bucket`), `span`
        the buckets (else `max_relative_positions`), the embeddings' first `2 span` rows, projected by the content's
        own projections with `share_att_key`, each term divided by the scale after its product."""
        span = attention.pos_ebd_size
        rows = embeddings[: 2 * span]
        s = divisor(queries.shape[-1], self.factor(attention.pos_att_type)).to(queries.dtype)
        i = torch.arange(queries.shape[2], device=queries.device)[:, None]
        j = torch.arange(keys.shape[2], device=queries.device)[None, :]
        relative = i - j
        if attention.position_buckets > 0 and attention.max_relative_positions > 0:
            relative = bucket(relative, attention.position_buckets, attention.max_relative_positions)
        distance = (relative + span).clamp(0, 2 * span - 1)
        shared = attention.share_att_key
        bias = 0
        if "c2p" in attention.pos_att_type:
            projection = attention.key_proj if shared else attention.pos_key_proj
            bias = bias + _gathered(queries, _per_head(projection(rows), attention), distance) / s
        if "p2c" in attention.pos_att_type:
            projection = attention.query_proj if shared else attention.pos_query_proj
            bias = bias + _gathered(keys, _per_head(projection(rows), attention), distance.T).transpose(-1, -2) / s
        return bias

    kind_reasons = {"conv": {"layer_output": CONV}}
    kind_notes = {
        "*": {
            "attention_queries": "query_proj's output as [batch, heads, seq, head_dim]: a view of the [batch * heads, "
            "seq, head_dim] tensor DeBERTa-v2 computes with (unscaled: the keys are divided by the scale)",
            "attention_keys": "key_proj's output as [batch, heads, seq, head_dim] (a view of the folded tensor), "
            "before DeBERTa-v2 divides it by sqrt(head_dim * (1 + number of relative terms)) (the scale)",
            "attention_values": "value_proj's output as [batch, heads, seq, head_dim] (a view of the folded tensor)",
            "attention_scores": lambda family, config, layer: (
                "queries @ (keys / sqrt(head_dim * (1 + number of relative terms)))^T"
                + (" + attention_position_bias" if terms(config) else "")
                + "; padded keys and padded queries' rows filled with the dtype's minimum"
            ),
            "attention_position_bias": lambda family, config, layer: _v2_bias_note(config),
            "attention_head_outputs": "the pattern times the values, as [batch, seq, heads, head_dim]",
        }
    }


def _v2_bias_note(config) -> str:
    """What DeBERTa-v2's `attention_position_bias` holds on a model of `config`: which terms, from what."""
    largest = config.max_relative_positions if config.max_relative_positions > 0 else config.max_position_embeddings
    buckets = getattr(config, "position_buckets", -1)
    normalised = "layer_norm" in str(getattr(config, "norm_rel_ebd", "none")).lower()
    return (
        f"[batch, num_heads, query, key] (a view of DeBERTa-v2's [batch * heads, query, key]): "
        f"{' + '.join(terms(config))} (pos_att_type), each divided by the scale as the scores are; computed in every "
        "layer from its own queries and keys and the encoder's relative embeddings"
        + (" (normalised: norm_rel_ebd)" if normalised else "")
        + (
            f", distances exact up to {buckets // 2} and in logarithmic buckets beyond (position_buckets={buckets}, "
            f"up to {largest})"
            if buckets > 0
            else f", distances clamped at {largest}"
        )
        + (
            ", projected by the layer's query_proj and key_proj (share_att_key)"
            if getattr(config, "share_att_key", False)
            else ", projected by the layer's pos_key_proj and pos_query_proj"
        )
        + "; assigning it moves the scores"
    )


def bucket(relative: torch.Tensor, buckets: int, largest: int) -> torch.Tensor:
    """DeBERTa-v2's bucket of each distance: itself up to half the buckets (`mid`), beyond that
    `sign * (mid + ceil((mid - 1) * log(|d| / mid) / log((largest - 1) / mid)))`, in float32 as it computes it."""
    mid = buckets // 2
    size = relative.abs()
    within = size <= mid
    logarithmic = torch.log(size.clamp(min=mid) / mid) / torch.log(torch.tensor((largest - 1) / mid))
    far = torch.ceil(logarithmic * (mid - 1)) + mid
    return torch.where(within, relative.to(far.dtype), far * torch.sign(relative)).long()


def _distances(num_queries: int, num_keys: int, span: int, device) -> torch.Tensor:
    """`clamp(i - j + span, 0, 2 span - 1)` for query i and key j: the row of the relative embeddings they read."""
    i = torch.arange(num_queries, device=device)[:, None]
    j = torch.arange(num_keys, device=device)[None, :]
    return (i - j + span).clamp(0, 2 * span - 1)


def _per_head(projected: torch.Tensor, attention) -> torch.Tensor:
    """[rows, heads * head_dim] -> [heads, rows, head_dim]."""
    return projected.view(projected.shape[0], attention.num_attention_heads, -1).transpose(0, 1)


def _gathered(content: torch.Tensor, positions: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """`content[b, h, i] . positions[h, distance[i, j]]` for every i, j: `[batch, heads, len(content), j]`."""
    products = torch.matmul(content, positions.transpose(-1, -2))  # [batch, heads, i, rows]
    index = distance[None, None].expand(*products.shape[:2], *distance.shape)
    return torch.take_along_dim(products, index, dim=-1)
