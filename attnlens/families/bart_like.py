"""Encoder-decoders built as BART is, with code of their own: MVP, BigBirdPegasus, NLLB-MoE, FSMT, and LED and
PEGASUS-X, whose encoders attend in local windows or blocks (their decoders served whole, their encoders' blocks
without their attention's own values).

- MVP: BART's post-norm blocks, whose attention (`MvpAttention`) is BART's older arithmetic, as XGLM's: the queries
  pre-scaled, the heads folded into the batch for `torch.bmm`, no clamp. With `config.use_prompt` the decoder learns
  prompts (`MvpPrompt`: per block, `prompt_length` keys and values per head, for the self-attention and the
  cross-attention) that the attention puts before the sequence's keys and values, visible to every query; the keys,
  values, scores and pattern then hold the prompt's positions first. MvpModel builds its encoder without prompts
  (transformers 5.19 and 5.25 hand `config.use_prompt` to MvpEncoder's `embed_tokens` argument).
- BigBirdPegasus: Pegasus's pre-norm blocks; each stack's final norm is `layernorm_embedding`. The decoder's
  attention is BART's; the encoder's (`BigBirdPegasusEncoderAttention`) holds BERT's inline self-attention
  (`self_attn.self`: query, key, value, `(q @ k^T) / sqrt(head_dim)`) and its own output projection
  (`self_attn.output`) when `config.attention_type` is `original_full`; `block_sparse` is refused (bert_inline.py).
- NLLB-MoE: M2M100's pre-norm blocks (`ff_layer_norm` before the MLP, `cross_attention` and its norm), whose MLP
  (`ffn`) is a sparse mixture of experts on every `encoder_sparse_step`-th / `decoder_sparse_step`-th block
  (`NllbMoeSparseMLP`: a top-2 router, then the experts on the tokens routed to them, weighted).
- FSMT: BART's post-norm blocks, run time-first: each block reads and returns `[seq, batch, hidden]` (the stacks
  transpose around their blocks), so attnlens serves the blocks' values transposed, `[batch, seq, hidden]` (views:
  edits land); its attention is MVP's folded arithmetic on time-first inputs. FSMTModel masks the decoder causally
  only where it runs without a cache (`use_cache` off).
- LED: BART's post-norm blocks; the encoder's attention is Longformer's (local windows plus global tokens), whose
  queries, keys, pattern and head outputs are refused; the decoder's is MVP's arithmetic.
- PEGASUS-X: Pegasus's pre-norm blocks; the encoder's attend within local blocks (staggered on every other block)
  plus global tokens, whose stream runs beside the sequence's through the same norms and MLP: its blocks serve the
  sequence stream's values, not the attention's own.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import Miswired
from ..family import EagerFunction, EncoderDecoder, Tiny
from ..locations import Derived, ModuleInput, ModuleOutput, Operation, softmax_argument
from ..locations.views import batch_folded, unfold_heads
from ..parts import identities, scoring
from ..parts.moe import SparseMoE, moe_absent
from ..parts.notes import Joined, Note
from ..parts.sizes import Sizes
from .bart import TINY, BartDecoder, BartEncoder, PreNormDecoder, PreNormEncoder
from .bert_inline import BlockSparse
from .xglm import folded

# --- MVP ---------------------------------------------------------------------------------------------------------

MVP_NOTES: dict[str, Note] = {
    "attention_queries": "pre-scaled: q_proj(x) * head_dim ** -0.5 (attn.scale is 1.0); a view of the heads folded "
    "into the batch",
    "attention_scores": "queries @ keys^T + mask (the queries carry the scale)",
}
MVP_EMBEDDED = (
    "the token embedding's output, unscaled (the stack multiplies it by sqrt(d_model) where config.scale_embedding); "
    "learned positions are added, then layernorm_embedding, before layers[0]"
)
NO_PROMPT_POSITION = (
    "config.use_prompt: the keys begin with the block's config.prompt_length prompt keys (MvpPrompt), which hold no "
    "position in the sequence"
)
PROMPT_NOTES: dict[str, Note] = {
    "attention_keys": "the block's prompt keys (config.prompt_length of them, the same for every batch row) first, "
    "then the sequence's",
    "attention_values": "the block's prompt values first, then the sequence's",
    "attention_probabilities": "over the prompt's positions first (every query sees them all), then the sequence's",
}
PROMPT_CACHE: dict[str, Note] = {
    "attention_cache_keys": Joined("the sequence's keys only: each call puts the prompt's before them anew"),
    "attention_cache_values": Joined("the sequence's values only: each call puts the prompt's before them anew"),
}


def cross(notes: dict) -> dict:
    return {f"cross_{name}": note for name, note in notes.items()}


class MvpEncoder(BartEncoder):
    """MVP's encoder: BART's post-norm encoder blocks of `MvpAttention`, whose values are read inside its own
    arithmetic (the heads folded into the batch)."""

    sizes = replace(BartEncoder.sizes, scale=(1.0,))
    eager = EagerFunction(only=())  # one attention path, whatever attn_implementation says

    def attention_locations(self, prefix: str = "") -> dict:
        return {
            f"{prefix}attention_queries": folded("query_states_2", "query_states.reshape(*proj_shape)", "queries"),
            f"{prefix}attention_keys": folded("key_states_4", "key_states.reshape(*proj_shape)", "keys"),
            f"{prefix}attention_values": folded("value_states_4", "value_states.reshape(*proj_shape)", "values"),
            # the softmax's argument: an unpadded encoder batch has no mask, so the `+ mask` step never runs
            f"{prefix}attention_scores": batch_folded(softmax_argument(), "scores"),
            f"{prefix}attention_probabilities": folded("attn_probs_0", "dropout(", "probabilities"),
            f"{prefix}attention_head_outputs": Operation(("attn_output_2",), anchor="attn_output.transpose(1, 2)"),
            f"{prefix}attention_premix": ModuleInput(self.output_projection),
            f"{prefix}attention_output": ModuleOutput("", 0),
        }

    def locations(self):
        return {**super().locations(), "layer_output": ModuleOutput("", 0)}  # MVP's blocks return tuples

    #: Whether the stack's blocks take prompts where `config.use_prompt`: MvpModel builds its encoder without them
    #: (transformers 5.19 and 5.25 hand config.use_prompt to MvpEncoder's `embed_tokens` argument).
    prompted = False

    def layer_kind(self, config, layer):
        prompted = self.prompted and getattr(config, "use_prompt", False)
        return super().layer_kind(config, layer) | ({"prompt"} if prompted else set())

    def verify(self, model, layer, layer_module, attention_module):
        built = bool(getattr(model, "use_prompt", False))
        if built != ("prompt" in self.layer_kind(model.config, layer)):
            raise Miswired(
                f"family {self.name}: the stack was built {'with' if built else 'without'} MVP's prompts "
                f"(use_prompt={built}), which the family does not expect on this config"
            )
        super().verify(model, layer, layer_module, attention_module)

    kind_reasons = {"prompt": {"attention_key_positions": NO_PROMPT_POSITION}}
    kind_notes = {
        "*": {
            **MVP_NOTES,
            "embeddings": MVP_EMBEDDED,
            "attention_keys": lambda family, config, layer: (
                "the sequence's own: MvpModel builds its encoder without prompts (transformers 5.19 and 5.25 hand "
                "config.use_prompt to MvpEncoder's embed_tokens argument); the decoder's attentions have them"
                if getattr(config, "use_prompt", False) and not family.prompted
                else None
            ),
        },
        "prompt": PROMPT_NOTES,
    }


class MvpDecoder(MvpEncoder, BartDecoder):
    """MVP's decoder: BART's post-norm decoder blocks of `MvpAttention`, the cross-attention's included."""

    prompted = True

    kind_reasons = {"prompt": {"attention_key_positions": NO_PROMPT_POSITION}}
    kind_notes = {
        "*": {**MVP_NOTES, **cross(MVP_NOTES), "attention_keys": None},
        "prompt": {**PROMPT_NOTES, **cross(PROMPT_NOTES), **PROMPT_CACHE},
    }


class Mvp(EncoderDecoder):
    """MVP: BART's post-norm encoder-decoder with attention of its own, and optional learned prompts."""

    model_types = ("mvp",)
    encoder = MvpEncoder
    decoder = MvpDecoder
    tiny = Tiny("MvpConfig", "MvpForConditionalGeneration", TINY)


BIGBIRD_EMBEDDED = (
    "the scaled token embedding's output; learned positions are added before layers[0] (layernorm_embedding is the "
    "stack's final norm)"
)

# --- BigBirdPegasus ---------------------------------------------------------------------------------------------


def _last_two_swapped(envoy, transposed):
    return transposed.transpose(-1, -2)


def _last_two_swapped_back(envoy, old, new):
    return new.transpose(-1, -2)


class BigBirdPegasusEncoder(BlockSparse, PreNormEncoder):
    """BigBirdPegasus's encoder: pre-norm blocks whose attention is BERT's inline self-attention (`self_attn.self`)
    and its output projection (`self_attn.output`), in `original_full`; `block_sparse` attention is refused."""

    final_norm = "layernorm_embedding"
    output_projection = "output"
    eager = EagerFunction(only=())  # one attention path, whatever attn_implementation says
    sizes = Sizes(
        num_heads=("self.num_attention_heads",),
        head_dim=("self.attention_head_size",),
        scale=(lambda module, found: found["head_dim"] ** -0.5,),
    )

    def attention_locations(self, prefix: str = "") -> dict:
        inner = dict(module="self")
        return {
            "attention_queries": Operation(("query_layer_0",), anchor="transpose", **inner),
            "attention_keys": Derived(
                Operation(("key_layer_transpose_0",), anchor="matmul", **inner),
                _last_two_swapped,
                _last_two_swapped_back,
                "attention_keys",
            ),
            "attention_scores": softmax_argument(**inner),
            "attention_probabilities": Operation(("attention_probs_1",), anchor="dropout", **inner),
            "attention_values": Operation(("torch_matmul_1",), "arg", 1, anchor="value_layer", **inner),
            "attention_head_outputs": Operation(("context_layer_1",), anchor="permute", **inner),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput("", 0),
        }

    kind_notes = {
        "*": {
            "attention_scores": "(queries @ keys^T) / sqrt(head_dim), plus the mask where the model built one "
            "(padding): what the softmax receives",
            "attention_keys": "read where the scores take them (the transposed operand of queries @ keys^T), "
            "transposed back",
            "final_norm_output": "layernorm_embedding(the last layer_output): the stack's final norm",
            "embeddings": BIGBIRD_EMBEDDED,
        },
        "block_sparse": {"attention_premix": "the block-sparse attention's merged head outputs (output's input)"},
    }


class BigBirdPegasusDecoder(PreNormDecoder):
    """BigBirdPegasus's decoder: Pegasus's pre-norm decoder blocks, full causal self-attention."""

    final_norm = "layernorm_embedding"
    kind_notes = {
        "*": {
            "final_norm_output": "layernorm_embedding(the last layer_output): the stack's final norm",
            "embeddings": BIGBIRD_EMBEDDED,
        }
    }


class BigBirdPegasus(EncoderDecoder):
    """BigBirdPegasus: Pegasus's pre-norm encoder-decoder whose encoder attends as BigBird does."""

    model_types = ("bigbird_pegasus",)
    encoder = BigBirdPegasusEncoder
    decoder = BigBirdPegasusDecoder
    tiny = Tiny(
        "BigBirdPegasusConfig", "BigBirdPegasusForConditionalGeneration", {**TINY, "attention_type": "original_full"}
    )


# --- NLLB-MoE ---------------------------------------------------------------------------------------------------


class NllbMoeBlocks(SparseMoE, PreNormEncoder):
    """NLLB-MoE's MLP (`ffn`): a dense `fc2(act(fc1(x)))`, or on every sparse step a sparse mixture of experts."""

    mlp = "ffn"
    mlp_norm = "ff_layer_norm"
    activation = "act"
    down_projection = "fc2"
    absent = moe_absent("NllbMoeExperts")
    #: The config's spacing of the sparse blocks in this stack.
    sparse_step = "encoder_sparse_step"

    def moe_layer(self, config, layer):
        step = getattr(config, self.sparse_step)
        return step > 0 and (layer + 1) % step == 0  # NllbMoeEncoder's and NllbMoeDecoder's own rule

    def locations(self):
        return {
            **super().locations(),
            "mlp_input": ModuleInput(self.mlp),
            "mlp_activation": ModuleOutput(self.activation),
            "mlp_neurons": ModuleInput(self.down_projection),
            "mlp_output": ModuleOutput(),  # the sparse MLP returns its output alone
        }

    class Identities(identities.Identities):
        def mlp_module(self, block):
            return block.get_submodule(self.family.mlp)  # a module of its own (BART's block runs its MLP itself)

        def mlp_forward(self, mlp, mlp_input, **arguments):
            return mlp(mlp_input)

    kind_notes = {
        "*": {"embeddings": "the scaled token embedding's output; sinusoidal positions are added before layers[0]"},
        "moe": {
            "mlp_output": "the sparse MLP's output: NllbMoeTop2Router gives each token the gates of its top-2 "
            "experts (within each expert's capacity); NllbMoeExperts (transformers 5.19, 5.25) picks the experts by "
            "the values of the router's one-hot mask, not by expert id, so each token gets (1 - moe_token_dropout) "
            "* (expert_1(x) * its top-1 gate + expert_0(x) * its top-2 gate), whichever experts the router chose",
        },
    }


class NllbMoeEncoder(NllbMoeBlocks):
    """NLLB-MoE's encoder: M2M100's pre-norm blocks, sparse MLPs every `encoder_sparse_step` blocks."""


class NllbMoeDecoder(NllbMoeBlocks, PreNormDecoder):
    """NLLB-MoE's decoder: pre-norm blocks with a cross-attention, sparse MLPs every `decoder_sparse_step` blocks."""

    cross_attention = "cross_attention"
    cross_attention_norm = "cross_attention_layer_norm"
    sparse_step = "decoder_sparse_step"


class NllbMoe(EncoderDecoder):
    """NLLB-MoE: M2M100's pre-norm encoder-decoder with sparse mixture-of-experts MLPs."""

    model_types = ("nllb-moe",)
    encoder = NllbMoeEncoder
    decoder = NllbMoeDecoder
    # Block 1 of each stack is sparse, block 0 dense: both kinds are tested.
    tiny = Tiny(
        "NllbMoeConfig",
        "NllbMoeForConditionalGeneration",
        {**TINY, "num_experts": 4, "expert_capacity": 16, "encoder_sparse_step": 2, "decoder_sparse_step": 2},
    )


TRANSPOSED = Joined("served [batch, seq, ...]: FSMT's blocks run time-first, this is a transposed view")

# --- FSMT -------------------------------------------------------------------------------------------------------

#: The block values FSMT forms time-first, `[seq, batch, ...]`: served transposed.
TIME_FIRST = (
    "layer_input",
    "attention_premix",
    "attention_output",
    "cross_attention_input",
    "cross_attention_premix",
    "cross_attention_output",
    "layer_mid",
    "mlp_norm_output",
    "mlp_input",
    "mlp_activation",
    "mlp_neurons",
    "mlp_output",
    "layer_output",
)


def _swap_time(envoy, tensor):
    return tensor.transpose(0, 1)


def _swap_time_back(envoy, old, new):
    return new.transpose(0, 1)


def _heads_last(envoy, folded_output):
    """`[batch * heads, seq, head_dim]` as `[batch, seq, heads, head_dim]`, a view."""
    return unfold_heads(envoy, folded_output).transpose(1, 2)


def _heads_folded(envoy, old, new):
    return new.transpose(1, 2).reshape(old.shape)


class FsmtEncoder(MvpEncoder):
    """FSMT's encoder: BART's post-norm encoder blocks run time-first, attention of MVP's folded arithmetic."""

    def attention_locations(self, prefix: str = "") -> dict:
        return {
            **super().attention_locations(prefix),
            f"{prefix}attention_queries": folded("query_states_1", "query_states.view(", "queries"),
            f"{prefix}attention_keys": folded("key_states_3", "key_states.reshape(", "keys"),
            f"{prefix}attention_values": folded("value_states_3", "value_states.reshape(", "values"),
            f"{prefix}attention_head_outputs": Derived(
                Operation(("attn_output_0",), anchor="torch.bmm(attn_probs"), _heads_last, _heads_folded, "heads"
            ),
        }

    def locations(self):
        found = super().locations()
        return {
            name: Derived(location, _swap_time, _swap_time_back, name) if name in TIME_FIRST else location
            for name, location in found.items()
        }

    #: The blocks read and return `[seq, batch, hidden]` (the KV cache's reader takes the attention's input so).
    time_first = True

    kind_notes = {
        "*": {
            **dict.fromkeys(TIME_FIRST, TRANSPOSED),
            "embeddings": "the token embedding's output, unscaled (the stack multiplies it by sqrt(d_model) where "
            "config.scale_embedding), [batch, seq, hidden]; sinusoidal positions are added and the sequence turned "
            "time-first before layers[0]",
        }
    }


class FsmtDecoder(FsmtEncoder, MvpDecoder):
    """FSMT's decoder: BART's post-norm decoder blocks run time-first. FSMTModel builds the causal mask only where it
    runs without a cache (`use_cache` False): with one, each step is one token, and a longer target read in one
    forward attends both ways, as transformers computes it."""

    class ScoreFunction(scoring.ScoreFunction):
        def causal(self, config):
            return not getattr(config, "use_cache", True)

    kind_reasons = {
        "*": {
            "attention_cache_visible": "FSMT's attention takes its masks as attn_mask (causal) and key_padding_mask, "
            "not the attention_mask keyword through which attnlens masks a removed position; edit the cached keys "
            "and values",
        }
    }
    kind_notes = {
        "*": {
            "attention_probabilities": lambda family, config, layer: (
                "causal: each decoder position sees the positions up to its own (config.use_cache is False)"
                if family.score_function().causal(config)
                else "config.use_cache is set, and FSMTModel then builds no causal mask: a target of several tokens "
                "read in one forward attends both ways (under generate each step is one token, which sees the cache)"
            ),
        }
    }


class Fsmt(EncoderDecoder):
    """FSMT (fairseq's WMT19 translation models): BART's post-norm encoder-decoder run time-first."""

    model_types = ("fsmt",)
    encoder = FsmtEncoder
    decoder = FsmtDecoder
    tiny = Tiny(
        "FSMTConfig",
        "FSMTForConditionalGeneration",
        {
            **{k: v for k, v in TINY.items() if k != "vocab_size"},
            "langs": ["en", "de"],
            "src_vocab_size": 128,
            "tgt_vocab_size": 128,
            "num_beams": 1,  # FSMT's config asks for a beam search of 5
            "use_cache": False,  # a plain forward masks the target causally only without a cache
        },
    )


#: The encoder block values of LED and PEGASUS-X over the positions of the (padded) source.
SEQUENCE_STREAM = (
    "layer_input",
    "attention_output",
    "layer_mid",
    "mlp_norm_output",
    "mlp_input",
    "mlp_activation",
    "mlp_neurons",
    "mlp_output",
    "layer_output",
)

# --- LED --------------------------------------------------------------------------------------------------------

#: The encoder attention's values LED's Longformer attention never forms as attnlens's vocabulary has them.
LOCAL_VALUES = (
    "attention_queries",
    "attention_keys",
    "attention_key_positions",
    "attention_values",
    "attention_scores",
    "attention_probabilities",
    "attention_head_outputs",
)
LOCAL_WINDOWS = (
    "LED's encoder attends as Longformer does (LEDEncoderSelfAttention): each query sees only the keys within "
    "attention_window / 2 positions on either side, plus the global tokens (global_attention_mask), scored over "
    "overlapping diagonal chunks; it never forms a query-by-key score or pattern tensor (transformers returns its "
    "pattern as bands, [batch, heads, seq, attention_window + 1 + globals]), and attnlens does not reproduce that "
    "attention yet. The encoder's blocks serve their inputs and outputs, the attention's merged heads "
    "(attention_premix) and output, and the MLP's values; the decoder is served whole"
)
WINDOW_PADDED = Joined(
    "the encoder pads the source with pad tokens (masked) to a multiple of config.attention_window before its "
    "blocks, so this holds those positions too; the encoder's output drops them"
)


class LedEncoder(BartEncoder):
    """LED's encoder: BART's post-norm blocks whose attention is Longformer's (`self_attn.longformer_self_attn`, local
    windows plus global tokens), then its output projection (`self_attn.output`); the attention's own values are
    refused."""

    output_projection = "output"
    sizes = Sizes(
        num_heads=("longformer_self_attn.num_heads",),
        head_dim=("longformer_self_attn.head_dim",),
        scale=(lambda module, found: found["head_dim"] ** -0.5,),
    )

    def attention_locations(self, prefix: str = "") -> dict:
        return {
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput("", 0),
        }

    def locations(self):
        return {**super().locations(), "layer_output": ModuleOutput("", 0)}  # LED's blocks return tuples

    kind_reasons = {"*": dict.fromkeys(LOCAL_VALUES, LOCAL_WINDOWS)}
    kind_notes = {
        "*": {
            **dict.fromkeys((*SEQUENCE_STREAM, "attention_premix"), WINDOW_PADDED),
            "embeddings": Joined(WINDOW_PADDED.note, before=True),
            "attention_premix": "the local-and-global attention's merged head outputs (self_attn.output's input)",
        }
    }


class LedDecoder(MvpDecoder):
    """LED's decoder: BART's post-norm decoder blocks whose attention (`LEDDecoderAttention`) is MVP's arithmetic
    without prompts."""

    prompted = False

    def attention_locations(self, prefix: str = "") -> dict:
        return {
            **super().attention_locations(prefix),
            f"{prefix}attention_keys": folded("key_states_3", "key_states.reshape(*proj_shape)", "keys"),
            f"{prefix}attention_values": folded("value_states_3", "value_states.reshape(*proj_shape)", "values"),
            f"{prefix}attention_head_outputs": Derived(
                Operation(("attn_output_0",), anchor="torch.bmm(attn_probs"), _heads_last, _heads_folded, "heads"
            ),
        }

    kind_notes = {
        "*": {
            "embeddings": "the token embedding's output; learned positions are added, then "
            "layernorm_embedding, before layers[0]"
        }
    }


class Led(EncoderDecoder):
    """LED (Longformer-Encoder-Decoder): BART's post-norm encoder-decoder whose encoder attends in local windows
    with global tokens (its attention's values refused), and whose decoder is BART's."""

    model_types = ("led",)
    encoder = LedEncoder
    decoder = LedDecoder
    stacks = {"encoder": "led.encoder", "decoder": "led.decoder"}
    tiny = Tiny(
        "LEDConfig",
        "LEDForConditionalGeneration",
        {
            **{k: v for k, v in TINY.items() if k != "max_position_embeddings"},
            "attention_window": 6,  # a six-token source needs no window padding (2 fails in transformers itself)
            "max_encoder_position_embeddings": 128,
            "max_decoder_position_embeddings": 128,
        },
    )


# --- PEGASUS-X --------------------------------------------------------------------------------------------------

BLOCK_LOCAL = (
    "PEGASUS-X's encoder attends in blocks (PegasusXGlobalLocalAttention): each position's query sees the keys of its "
    "own block of config.block_size positions (every other layer's blocks staggered by half a block) and the "
    "config.num_global_tokens global tokens, whose stream runs beside the sequence's through every block; it never "
    "forms one query-by-key score or pattern tensor over the sequence, and attnlens does not reproduce that attention "
    "yet. The encoder's blocks serve the sequence stream's values (inputs, norms, the attention's output, the MLP's), "
    "not the global tokens' stream; the decoder is served whole"
)
#: The values of PEGASUS-X's encoder attention attnlens does not serve: its own (as LED's), and the merged heads,
#: which `out_proj` receives twice a block (the global tokens', then the sequence's).
BLOCK_LOCAL_VALUES = (*LOCAL_VALUES, "attention_premix")
BLOCK_PADDED = Joined(
    "the encoder pads the source with zeros (masked) to a multiple of config.block_size before its blocks, so this "
    "holds those positions too; the encoder's output drops them"
)


def _unstaggered(envoy, padded):
    """A staggered block's attention output `[batch, half block + seq + half block, hidden]` as the block then uses
    it (`unpad_local_tokens`): a view."""
    half = envoy._module.block_size // 2
    return padded[:, half:-half]


def _restaggered(envoy, old, new):
    half = envoy._module.block_size // 2
    return torch.cat([old[:, :half], new, old[:, -half:]], dim=1)


class PegasusXEncoder(PreNormEncoder):
    """PEGASUS-X's encoder: pre-norm blocks over the sequence and a stream of global tokens beside it (the same norms,
    attention and MLP, run on each), the sequence attending within local blocks and to the global tokens."""

    sizes = replace(BartEncoder.sizes, scale=(1.0,))  # the queries are pre-scaled

    def attention_locations(self, prefix: str = "") -> dict:
        return {  # the norm's first call is the sequence's (global_self_attn_layer_norm is the global tokens')
            "attention_norm_output": ModuleOutput(self.attention_norm),
            "attention_output": ModuleOutput("", 0),  # the sequence's output (the global tokens' is item 1)
        }

    def layer_kind(self, config, layer):
        staggered = getattr(config, "stagger_local_blocks", False) and layer % 2 == 1
        return super().layer_kind(config, layer) | ({"staggered"} if staggered else set())

    def kind_locations(self, kind, config, engine):
        found = super().kind_locations(kind, config, engine)
        if "staggered" in kind:
            found = {**found, "attention_output": Derived(found["attention_output"], _unstaggered, _restaggered)}
        return found

    def locations(self):
        return {**super().locations(), "layer_output": ModuleOutput("", 0)}  # (the sequence, the global tokens)

    kind_reasons = {"*": dict.fromkeys(BLOCK_LOCAL_VALUES, BLOCK_LOCAL)}
    kind_notes = {
        "*": {
            **{
                name: BLOCK_PADDED
                for name in TIME_FIRST
                if not name.startswith("cross_") and name != "attention_premix"
            },
            "attention_norm_output": BLOCK_PADDED,
            "embeddings": "the scaled token embedding's output; sinusoidal positions are added before layers[0] "
            "(and the source padded to a multiple of config.block_size)",
        },
        "staggered": {
            "attention_output": Joined(
                "this block's blocks are staggered: the attention ran over the sequence padded by half a block on "
                "each side, which the block drops (a view of the rest)"
            ),
        },
    }


class PegasusXDecoder(PreNormDecoder):
    """PEGASUS-X's decoder: Pegasus's pre-norm decoder blocks."""

    kind_notes = {
        "*": {"embeddings": "the scaled token embedding's output; sinusoidal positions are added before layers[0]"}
    }


class PegasusX(EncoderDecoder):
    """PEGASUS-X: Pegasus's pre-norm encoder-decoder whose encoder attends within local blocks plus global tokens
    (its attention's own values refused), and whose decoder is Pegasus's."""

    model_types = ("pegasus_x",)
    encoder = PegasusXEncoder
    decoder = PegasusXDecoder
    tiny = Tiny(
        "PegasusXConfig",
        "PegasusXForConditionalGeneration",
        {**TINY, "block_size": 2, "num_global_tokens": 2, "stagger_local_blocks": True},
    )
