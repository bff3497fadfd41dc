"""XLM and FlauBERT: post-norm, bidirectional encoders whose blocks are no modules.

`XLMModel` (`transformer`, FlauBERT's `FlaubertModel` is a copy of it) keeps each block's sublayers in four parallel
`ModuleList`s and runs them in its own loop: for block i, `attentions[i]` (a `MultiHeadAttention`: `q_lin`, `k_lin`,
`v_lin`, the arithmetic inline, `out_lin`), `layer_norm1[i](stream + attention's output)`, `ffns[i]` (a
`TransformerFFN`: `lin1`, gelu or relu, `lin2`, dropout) and `layer_norm2[i](stream + ffn's output)`, then the stream
multiplied in place by the padding mask. Before the blocks, the word embeddings (`embeddings`) plus the learned
positions, the language embeddings where the run gives `langs` (and the model has several languages), and the token
types embedded by the word embeddings again (where the run gives `token_type_ids`), through `layer_norm_emb`, times
the padding mask. No final norm: the masked-LM head (`pred_layer.proj`) reads the last block's output.

**What `layers[i]` is.** Block i gathered: a module holding `attentions[i]` (renamed `self_attn`), `layer_norm1[i]`,
`ffns[i]` (renamed `mlp`) and `layer_norm2[i]` under those names, which is no part of the model
(`attnlens.applications.GatheredBlock`: the family's `gathered`); every read and write goes to the model's own
modules. `layers[i]` has no input or output of its own (the model never calls one): `layer_input` is what
`self_attn` receives, `layer_output` what `layer_norm2[i]` returns.

`MultiHeadAttention` computes `scores = (q / sqrt(head_dim)) @ k^T`, fills the masked entries with the dtype's
minimum (`masked_fill_`, not an additive mask), the softmax in float32, dropout, `@ v`, heads merged, `out_lin`.

FlauBERT adds `pre_norm` (norms before each sublayer), which transformers' FlauBERT cannot run (its forward indexes
its `EncoderDecoderCache`), and `layerdrop` (each block skipped at random in training mode; in eval every block runs).
XLM's causal configuration (`config.causal`, its CLM checkpoints) is not served.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..family import Family, Joined, Tiny
from ..locations import Derived, ModuleInput, ModuleOutput, Operation, OutputField, softmax_argument
from ..parts import identities, scoring
from ..parts.eager import EagerFunction
from ..parts.sizes import Sizes
from ..parts.vllm import encoder_on_vllm
from ..values import ALL_VALUES
from .bert import POST_NORM

CAUSAL = (
    "{name} built causal (config.causal: the CLM checkpoints) masks the future with get_masks' triangle and no "
    "padding, and attnlens has not compared it with transformers; attnlens serves the bidirectional (MLM) configuration"
)
PRE_NORM = (
    "FlauBERT with pre_norm=True does not run in transformers: FlaubertModel.forward calls each attention with "
    "cache=cache[i], an index into the EncoderDecoderCache it built, which raises TypeError"
)


def _keys(envoy, transposed):
    return transposed.transpose(-1, -2)


def _untranspose(envoy, old, new):
    return new.transpose(-1, -2)


class XLM(Family):
    model_types = ("xlm",)
    vllm = encoder_on_vllm("XLM")
    # no tiny recipe: XLMWithLMHeadModel is transformers' causal LM for the type, so the suites that build every
    # causal-LM type build it causal (refused); FlauBERT's recipe, the same code, runs the encoder suites
    tiny: ClassVar[Tiny | None] = None
    layers = "transformer.attentions"  # each block's first module; `gathered` lists the block's modules
    embed_tokens = "transformer.embeddings"
    final_norm = None
    attention = "self_attn"  # the names of the gathered block's modules
    attention_norm = None
    mlp_norm = "layer_norm1"
    mlp = "mlp"
    output_projection = "out_lin"
    activation = "act"
    down_projection = "lin2"
    eager = EagerFunction(only=())  # the attention computes itself, whatever attn_implementation says
    sizes = Sizes(
        num_heads=("n_heads",),
        head_dim=("head_dim",),
        scale=(lambda module, found: found["head_dim"] ** -0.5,),
    )
    #: The lists holding the blocks' modules, by the gathered block's names for them.
    lists = {"self_attn": "attentions", "layer_norm1": "layer_norm1", "mlp": "ffns", "layer_norm2": "layer_norm2"}

    def gathered(self, config):
        # under the head model's `transformer`, or at the top of a bare XLMModel (`layers` rebased at load)
        model = self.layers.rpartition(".")[0]
        prefix = f"{model}." if model else ""
        return tuple({name: f"{prefix}{path}.{i}" for name, path in self.lists.items()} for i in range(config.n_layers))

    def locations(self):
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput("self_attn"),
            "attention_queries": Operation(("q_0",), anchor="self.q_lin("),
            # the keys as the scores read them (after the cache update), transposed back
            "attention_keys": Derived(
                Operation(("k_transpose_0",), anchor="k.transpose"), _keys, _untranspose, "attention_keys"
            ),
            "attention_scores": softmax_argument(),
            "attention_probabilities": Operation(("weights_1",), anchor="dropout("),
            "attention_values": Operation(("torch_matmul_1",), "arg", 1, anchor="weights, v"),
            "attention_head_outputs": Operation(("context_transpose_0",), anchor="context.transpose(1, 2)"),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput("", 0),
            "layer_mid": ModuleInput(self.mlp_norm),
            "mlp_norm_output": ModuleOutput(self.mlp_norm),
            "mlp_input": ModuleInput(self.mlp),
            "mlp_activation": ModuleInput(self.down_projection),  # the activation is a function: lin2 receives it
            "mlp_neurons": ModuleInput(self.down_projection),
            "mlp_output": ModuleOutput(),
            "layer_output": ModuleOutput("layer_norm2"),
            "logits": OutputField("logits"),
        }

    def refusal(self, config) -> str | None:
        """Why a model of `config` is not served at all (None: it is)."""
        return CAUSAL.format(name=self.name) if config.causal else None

    def unavailable(self, config, layer, engine="transformers"):
        reasons = super().unavailable(config, layer, engine)
        refused = self.refusal(config)
        if refused is not None:  # every value the family would serve, refused; the others keep their reasons
            return {value.name: reasons.get(value.name, refused) for value in ALL_VALUES}
        return reasons

    class ScoreFunction(scoring.ScoreFunction):
        def causal(self, config):
            """Bidirectional, unless built causal (config.causal: served by no engine, `refusal` says why)."""
            return bool(config.causal)

        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            """`(q / sqrt(head_dim)) @ k^T` (the queries divided, as XLM computes it), the entries of padded keys
            filled with the dtype's minimum."""
            scores = self.products(queries / heads.head_dim**0.5, keys)
            if key_mask is not None:
                scores = scores.masked_fill(~key_mask[:, None, None, :].bool(), torch.finfo(scores.dtype).min)
            return scores

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update, **arguments):
            """Post-norm: the attention's update joins the block input before `layer_norm1` (`layer_mid`); the MLP's
            joins `layer_norm1`'s output, and `layer_norm2` follows (then the padding mask, 1 on real tokens)."""
            if sublayer == "attention":
                return stream + update
            return block.layer_norm2(block.layer_norm1(stream) + update)

        def mlp_arithmetic(self, mlp):
            return identities.MLPArithmetic(
                output=mlp.lin2,
                activation_input=mlp.lin1,
                act=mlp.act,
                neurons=lambda x, activation: activation,
                says=("lin1(mlp input)", "activation", "lin2(neurons)"),
            )

    kind_reasons = {
        "*": {
            "attention_norm_output": POST_NORM.format(what="the attention reads the block input itself").replace(
                "BERT", "{family.name}"
            ),
            "final_norm_output": "{family.name} has no final norm: its head reads the last block's output, which "
            "ends in that block's layer_norm2",
        }
    }

    kind_notes = {
        "*": {
            "layer_input": lambda family, config, layer: (
                (
                    "layer_norm_emb(word + position embeddings, + lang_embeddings(langs) where the run gives langs, + "
                    "the word embeddings of token_type_ids where it gives them) times the padding mask; "
                    if layer == 0
                    else ""
                )
                + "what self_attn (attentions[i]) receives: the block is no module of its own"
            ),
            "attention_queries": "before the division by sqrt(head_dim); no rotary embedding: positions were added "
            "to the embeddings",
            "attention_keys": "read where the scores take them (the transposed operand of q @ k^T, after the cache "
            "update the forward always makes), transposed back",
            "attention_scores": "(queries / sqrt(head_dim)) @ keys^T, padded keys filled with the dtype's minimum: "
            "what the softmax receives",
            "attention_probabilities": "bidirectional: every query sees every key that is not padding",
            "attention_output": "out_lin's output (dropout, the identity in eval, follows)",
            "layer_mid": "layer_input + attention_output, what layer_norm1 receives (post-norm)",
            "mlp_norm_output": "layer_norm1(layer_mid): the MLP's input and the stream its output joins",
            "mlp_activation": "the activation's output (gelu, or relu without gelu_activation: a function, no "
            "module), read as what lin2 receives: the same tensor",
            "mlp_neurons": "what lin2 receives, equal to mlp_activation (no gate)",
            "mlp_output": "ffns[i]'s output: lin2's, then dropout (the identity in eval)",
            "layer_output": "layer_norm2(mlp_norm_output + mlp_output), which the forward then multiplies in place "
            "by the padding mask (zero on padded positions; a saved tensor shows the product)",
        }
    }


class Flaubert(XLM):
    model_types = ("flaubert",)
    vllm = encoder_on_vllm("FlauBERT")
    tiny = Tiny("FlaubertConfig", "FlaubertWithLMHeadModel", {"num_key_value_heads": None})

    def refusal(self, config):
        return PRE_NORM if config.pre_norm else super().refusal(config)

    kind_notes = {
        "*": {
            "layer_output": Joined(
                "with layerdrop (config.layerdrop) in training mode a block may be skipped: its values are then "
                "never formed, and a read of them fails at the end of the trace"
            )
        }
    }
