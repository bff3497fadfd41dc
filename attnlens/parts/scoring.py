"""The score function: how a family turns queries and keys into the scores entering the softmax, and the pattern
(scale, grouped heads, soft-cap, causal mask and sliding window, ALiBi, sinks, a score bias), on one engine.

`ScoreFunction` is the common layout's eager function. A family that computes a step otherwise says so in a nested
class of its own, `class ScoreFunction(scoring.ScoreFunction)`, overriding that step; `Family` composes it with its
bases' (a mixin's, a parent family's), so `super()` reaches the step the family would otherwise take.
`family.score_function(engine)` is the part for one engine: where the engines' kernels differ (vLLM's window one
wider, ALiBi added once), `self.engine` says which one it stands for. The same code serves the identities, patterns
rebuilt on sdpa and on vLLM, head summaries and the docs."""

from __future__ import annotations

from typing import ClassVar

import torch

from ..geometry import HeadGeometry


class ScoreFunction:
    """The score function of `family` on `engine` ("transformers" or "vllm") and its steps."""

    def __init__(self, family, engine: str = "transformers"):  # (a Family: the layer above this one)
        self.family = family
        self.engine = engine
        #: Which image each position of the prompt belongs to ([batch, sequence], -1 off images: `Positions.image`),
        #: for a multimodal family whose mask lets an image's tokens see each other; None: a text prompt.
        self.image_of: torch.Tensor | None = None
        #: Which positions form a prefix that attends both ways ([batch, sequence] bool: each sees every other, the
        #: rest causally), for a prefix-LM family (PaliGemma: `ImageTokens.prefix`, from its token types); None: none.
        self.prefix: torch.Tensor | None = None

    def alibi_slopes(self, config, layer: int) -> torch.Tensor | None:
        """The per-head ALiBi slopes vLLM's kernel holds for `layer` (float32), or None where it adds no ALiBi: checked
        against the kernel at load."""
        return None

    def softcap(self, config, layer: int) -> float | None:
        """The score soft-cap (`tanh(s / c) * c`) applied before the mask, or None."""
        return None

    def score_bias(self, config, layer: int) -> str | None:
        """What `layer`'s scores add that the queries and keys cannot give (Inkling's relative-position bias, computed
        from each query's hidden state), in words, or None (the default): the score function gives the scores. Where
        there is one, `scores()` leaves it out, patterns are neither rebuilt nor summarised from the queries and keys
        on that layer, and the identities add `score_bias_value` to the score function."""
        return None

    def beyond_queries_and_keys(self, config, layer: int) -> str | None:
        """Why the score function on queries and keys alone does not give `layer`'s pattern (what rebuilt patterns
        and head summaries compute it from), or None: a sink logit, scores that depend on the values, a score bias."""
        if self.scores_need_values:
            return f"the {self.family.name} family's scores depend on the values ({self.scores_need_values})"
        if "attention_sinks" in self.family.locations_for(config, layer):
            return "the softmax also takes each head's sink logit"
        bias = self.score_bias(config, layer)
        if bias is not None:
            return f"the scores add {bias}, which the queries and keys cannot give"
        return None

    def sliding_window(self, config, layer: int) -> int | None:
        """How many keys back a query of `layer` sees (itself included) in transformers, or None for full causal
        attention."""
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if layer_types is not None:
            return window if layer_types[layer] == "sliding_attention" else None
        return window

    def window(self, config, layer: int) -> int | None:
        """The sliding window this engine applies to `layer`: transformers', or `VLLMLayout.window` where vLLM's
        kernel differs."""
        if self.engine == "vllm" and self.family.vllm.window is not None:
            return self.family.vllm.window(self.family, config, layer)
        return self.sliding_window(config, layer)

    def layer_key(self, config, layer: int) -> tuple | None:
        """What `layer`'s scores depend on besides its queries, keys and heads: layers with equal keys (and heads)
        score alike, so one call can score them together (`heads.score_groups`). None where the family scores,
        masks or groups heads in a way of its own, which may read the layer any way: such a layer stands alone."""
        if any(self._own(name) for name in ("scores", "mask", "repeat_kv")):
            return None
        return self.window(config, layer), self.softcap(config, layer)

    def common_layout(self, heads: HeadGeometry, config, layer: int) -> dict | None:
        """`scale`, `softcap` and `window` where `layer` scores as the common layout does (`scale * q.k`, soft-capped,
        masked causally within the window, heads paired as `repeat_kv` pairs them by default): what the compiled
        kernel computes from them alone (`attnlens.kernels.row_statistics`). None where the family computes a step
        its own way."""
        if self.layer_key(config, layer) is None or self._own("products"):
            return None
        return {"scale": heads.scale, "softcap": self.softcap(config, layer), "window": self.window(config, layer)}

    def layer_groups(self, config, geometry, layers) -> list[list[int]]:
        """`layers` in runs of consecutive ones that score alike (equal `layer_key`s and heads, `geometry(layer)`):
        a run's queries and keys can be stacked on the batch axis and scored in one call as its first layer."""
        groups: list[list[int]] = []
        last = None
        for layer in layers:
            key = self.layer_key(config, layer)
            key = None if key is None else (key, geometry(layer))
            if key is None or key != last or not groups:
                groups.append([layer])
            else:
                groups[-1].append(layer)
            last = key
        return groups

    def _own(self, step: str) -> bool:
        """Whether the family computes `step` in a way of its own (overrides the common layout's)."""
        return getattr(type(self), step) is not getattr(ScoreFunction, step)

    # --- the score function ----------------------------------------------------------------------------------

    #: Why the score function also needs the layer's values (`scores(..., values=)`), or None where the queries and
    #: keys determine the scores: Doge adds a dynamic mask computed from the values. The identity suite passes them;
    #: head summaries and patterns rebuilt on sdpa, which read only the queries and keys, refuse such a family.
    scores_need_values: ClassVar[str | None] = None

    def scores(
        self,
        heads: HeadGeometry,
        config,
        queries: torch.Tensor,
        keys: torch.Tensor,
        layer: int,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The scores entering the softmax, computed the way the family computes them.

        `queries` [batch, num_heads, query, qk_head_dim], `keys` [batch, num_kv_heads, key, qk_head_dim] as read;
        the queries are the last `query` positions of the keys (a prefill, or decode steps against a cache).
        `key_mask` [batch, key] is 1 for real tokens, 0 for padding. Masked entries hold the dtype's minimum. Every
        tensor made here is made on the queries' device.
        """
        # in place on tensors made here (the same numbers; a third less time on a long prompt's pattern)
        scores = self.products(queries, keys).mul_(heads.scale)
        cap = self.softcap(config, layer)
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap  # (not in place: tanh keeps its output for the backward)
        sizes = queries.shape[2], keys.shape[2]
        mask = self.mask(*sizes, config, layer, key_mask, scores.dtype, scores.device)
        return scores.add_(mask)

    def cross_scores(
        self,
        heads: HeadGeometry,
        config,
        queries: torch.Tensor,
        keys: torch.Tensor,
        layer: int,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """An encoder-decoder's cross-attention scores: the decoder's queries against the encoder's keys, scaled, no
        causal mask or window (every query sees every source position), masked only where the source is padding
        (`key_mask` [batch, source])."""
        scores = self.products(queries, keys).mul_(heads.scale)
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :].bool(), torch.finfo(scores.dtype).min)
        return scores

    def products(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Each query head's dot products with its key/value head's keys, `[batch, heads, query, key]`. Where the heads
        pair as `repeat_kv` pairs them by default (each key/value head's query heads in a row), a key/value head's
        queries are scored in one product, with no copy of its keys (the same numbers, half the time on short rows)."""
        groups = queries.shape[1] // keys.shape[1]
        if groups == 1 or self._own("repeat_kv"):
            return torch.matmul(queries, self.repeat_kv(keys, groups).transpose(2, 3))
        batch, num_heads, num_queries, dim = queries.shape
        grouped = queries.reshape(batch, keys.shape[1], groups * num_queries, dim)
        return torch.matmul(grouped, keys.transpose(2, 3)).view(batch, num_heads, num_queries, -1)

    def repeat_kv(self, tensor: torch.Tensor, groups: int) -> torch.Tensor:
        """Keys or values `[batch, num_kv_heads, ...]` repeated to one per query head, paired the way the family's
        attention pairs them: each key/value head's `groups` query heads in a row (`repeat_interleave`, transformers'
        `repeat_kv`), unless the family tiles them (JetMoE's `repeat(1, top_k, 1, 1)`)."""
        return tensor.repeat_interleave(groups, dim=1)

    def softmax(
        self, scores: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pattern from the scores, in float32 as the eager functions compute it, and each query's sink share
        where the layer's heads have sink logits (`sinks` [heads]; None without): the softmax over the keys and one
        sink column, the column dropped (GPT-OSS's eager function), so each row sums to one less the share."""
        if sinks is None:
            return scores.softmax(-1, dtype=torch.float32).to(scores.dtype), None
        column = sinks.to(scores)[None, :, None, None].expand(*scores.shape[:-1], 1)
        joined = torch.cat([scores, column], dim=-1)
        joined = joined - joined.max(dim=-1, keepdim=True).values
        probabilities = joined.softmax(-1, dtype=joined.dtype)
        return probabilities[..., :-1], probabilities[..., -1]

    def causal(self, config) -> bool:
        """Whether a query sees only the keys up to its own position (a decoder), or every key (an encoder's
        bidirectional attention: BERT's, unless its config makes it a decoder)."""
        return True

    def mask(
        self, num_queries, num_keys, config, layer, key_mask=None, dtype=torch.float32, device=None
    ) -> torch.Tensor:
        """The additive mask this engine applies: 0 where a query sees a key, the dtype's minimum elsewhere.
        [batch or 1, 1, q, k]."""
        key_positions = torch.arange(num_keys, device=device)
        query_positions = key_positions[num_keys - num_queries :, None]
        visible = key_positions[None, :] <= query_positions
        if not self.causal(config):
            visible = torch.ones_like(visible)
        window = self.window(config, layer)
        if window is not None:
            visible &= query_positions - key_positions[None, :] < window
        visible = visible[None, None]
        if key_mask is not None:
            visible = visible & key_mask[:, None, None, :].bool().to(visible.device)
        return torch.where(visible, torch.zeros((), dtype=dtype, device=visible.device), torch.finfo(dtype).min)


class Bidirectional(ScoreFunction):
    """An encoder's score function: every query sees every key that is not padding, whatever the config says."""

    def causal(self, config) -> bool:
        return False


class Causal(ScoreFunction):
    """A decoder's, where its family derives from an encoder's (`Bidirectional`): each query sees the keys up to its
    own position. (Stated as a class of its own: `ScoreFunction` itself, a base of `Bidirectional`, would give way to
    it when a family's parts are composed.)"""

    def causal(self, config) -> bool:
        return True
