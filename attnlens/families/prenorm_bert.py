"""BERT's block with its LayerNorms moved in front of each sublayer (Megatron-BERT, RoBERTa-PreLayerNorm,
XLM-RoBERTa-XL, ESM), and RoFormer: BERT's post-norm block with rotary positions in an attention that computes itself.

A pre-norm BERT block (`PreNormBert`) keeps BERT's modules: `attention` (renamed `self_attn`: `self`, then `output`,
whose forward is `dense(heads merged) + layer_input`, with no norm after the add), `intermediate` (dense and
activation) and `output` (renamed `mlp`: `dense(activation) + stream`). The norms sit in front of the sublayers
instead: the attention's (`attention_norm_output`, what `self` receives), the MLP's (`mlp_norm_output`, what
`intermediate`'s dense receives), and a final norm after the last block (`final_norm_output`). Each type places them
under names of its own (`attention.ln` and `ln` on Megatron-BERT, `attention.LayerNorm` and
`intermediate.LayerNorm` on RoBERTa-PreLayerNorm, ...); `prenorm_shaped` builds a type's family from them.

Megatron-BERT's and RoFormer's self-attention computes the scores itself (`torch.matmul`, `/ sqrt(head_dim)`, the mask,
softmax, dropout, `torch.matmul` with the values), on every attention implementation (`OwnAttention`): the queries and
keys are read as the scores' product receives them (RoFormer's after its rotary embedding), the values as the pattern's
product receives them. ESM calls the shared attention interface with queries scaled by `1/sqrt(head_dim)` before it
(and before its rotary embedding, where `config.position_embedding_type` is "rotary"; "absolute", the default, adds
learned position embeddings instead), and a scaling of 1.
"""

from __future__ import annotations

from ..family import EagerFunction, Tiny, VLLMLayout
from ..locations import Derived, ModuleInput, ModuleOutput, Operation, insert_after, softmax_argument
from ..locations.cache import NAMES as CACHE_VALUES
from ..locations.cache import CacheEntries
from ..parts import identities
from ..parts.sizes import Sizes
from ..parts.vllm import encoder_on_vllm
from .bert import ROBERTA_POSITIONS, Bert

NOT_MEASURED = (
    "attnlens has not yet compared vLLM with transformers on {name} (the lead measures vLLM per family separately), "
    "so it serves it on neither of vLLM's paths; the transformers engine serves the family"
)


def keys_untransposed(envoy, transposed):
    """The keys as the scores' product receives them (`key_layer.transpose(-1, -2)`), back to [batch, heads, key, d]."""
    return transposed.transpose(-1, -2)


def keys_transposed(envoy, old, new):
    return new.transpose(-1, -2)


def _rotary(config) -> bool:
    return getattr(config, "position_embedding_type", None) == "rotary"


class PreNormBert(Bert):
    """BERT's modules with a LayerNorm in front of each sublayer and a final one: the residual adds are plain sums."""

    #: The norm in front of the attention and the one in front of the MLP (paths in a block), the final norm (in the
    #: model), and the module whose input is the MLP's input (`intermediate`, or its dense where `intermediate` holds
    #: the MLP's norm).
    attention_norm = "attention.LayerNorm"
    mlp_norm = "LayerNorm"
    final_norm: str | None = None  # each type names its own
    mlp_reads = "intermediate"
    padding_changes_values = ROBERTA_POSITIONS

    def locations(self):
        found = super().locations()  # BERT's attention and MLP values, on this family's paths
        found = insert_after(found, "layer_input", "attention_norm_output", ModuleOutput(self.attention_norm))
        # the cache is read at the attention module's input, which comes before the norm it holds
        for which, name in reversed(list(enumerate(CACHE_VALUES))):
            found = insert_after(found, "layer_input", name, CacheEntries(which))
        found.update(
            layer_mid=ModuleInput(self.mlp_norm),
            mlp_norm_output=ModuleOutput(self.mlp_norm),
            mlp_input=ModuleInput(self.mlp_reads),
            layer_output=ModuleOutput("", 0),
        )
        return insert_after(found, "layer_output", "final_norm_output", ModuleOutput(self.final_norm))

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update, **arguments):
            """Pre-norm: each sublayer's output joins the stream it read, and no norm follows the add (`output`'s
            forward, `dense(x) + input_tensor`, in the attention and the block alike)."""
            return stream + update

    kind_reasons = {"*": {"attention_norm_output": None, "final_norm_output": None}}

    kind_notes = {
        "*": {
            "attention_norm_output": "{family.attention_norm}(layer_input): what the attention's `self` receives "
            "(pre-norm)",
            "attention_output": "attention.output.dense's output (its dropout, the identity in eval, follows); "
            "attention.output adds it to layer_input, with no norm after",
            "layer_mid": "layer_input + attention_output: the attention's output, what {family.mlp_norm} receives "
            "(pre-norm: no norm after the add)",
            "mlp_norm_output": "{family.mlp_norm}(layer_mid): the MLP's input",
            "layer_output": "layer_mid + mlp_output: output's forward adds the MLP's output to layer_mid, with no norm "
            "after (pre-norm)",
            "final_norm_output": "{family.final_norm}(the last block's layer_output): what the LM head reads",
            "layer_input": lambda family, config, layer: (
                "BertEmbeddings-style sum of the word, token type and position embeddings" if layer == 0 else None
            ),
        }
    }


class NormedIntermediateMLP(identities.IntermediateMLP):
    """The MLP where `intermediate` normalises first (RoBERTa-PreLayerNorm's `intermediate.LayerNorm`): from the MLP's
    input (the norm's output), `output.dense(act(intermediate.dense(x)))`."""

    def __call__(self, hidden_states):
        intermediate = self.block.intermediate
        return self.dense(intermediate.intermediate_act_fn(intermediate.dense(hidden_states)))


class NormInIntermediate(identities.Identities):
    def mlp_module(self, block):
        return NormedIntermediateMLP(block)


class OwnAttention(Bert):
    """BERT's attention as Megatron-BERT and RoFormer write it: computed in the self-attention's own forward, whatever
    the attention implementation (no attention interface), and the block returning a tuple."""

    eager = EagerFunction(only=())  # the scores and the pattern are formed on every implementation
    sizes = Sizes(
        num_heads=("self.num_attention_heads",),
        head_dim=("self.attention_head_size",),
        scale=(lambda module, found: found["head_dim"] ** -0.5,),  # `/ math.sqrt(self.attention_head_size)`
    )

    def locations(self):
        inner = dict(module="self")
        product = ("torch_matmul_0",)  # torch.matmul(query_layer, key_layer.transpose(-1, -2))
        own = {
            "attention_queries": Operation(product, "arg", 0, anchor="torch.matmul(query_layer", **inner),
            "attention_keys": Derived(
                Operation(product, "arg", 1, anchor="key_layer.transpose", **inner),
                keys_untransposed,
                keys_transposed,
                "keys",
            ),
            # without padding an encoder's mask is None and `+ attention_mask` never runs: the softmax's argument is
            # the scores, masked or not
            "attention_scores": softmax_argument(**inner),
            "attention_probabilities": Operation(("attention_probs_1",), anchor="dropout", **inner),
            # the values as the pattern mixes them (after any cache update): read after the pattern
            "attention_values": Operation(("torch_matmul_1",), "arg", 1, anchor="value_layer", **inner),
            "attention_head_outputs": Operation(("context_layer_1",), anchor="permute", **inner),
        }
        found = {}
        for name, location in super().locations().items():  # the attention's values replaced, in forward order
            if name == "attention_queries":
                found.update(own)
            elif name not in own:
                found[name] = location
        return {**found, "layer_output": ModuleOutput("", 0)}  # the block returns a tuple


def prenorm_shaped(
    name: str,
    model_type: str,
    base: str,
    config: str,
    causal_lm: str,
    summary: str,
    family: type[Bert] = PreNormBert,
    **own,
) -> type[Bert]:
    """`family` (a pre-norm BERT, by default) on a type with a causal LM: its base model under `base`, its classes
    (`config`, `causal_lm`, and beside them `<Prefix>Attention`, `<Prefix>Output`, renamed `self_attn` and `mlp`), and
    its own attributes (`own`: norm paths, notes, reasons)."""
    notes = own.pop("kind_notes", {})
    probabilities = {
        "attention_probabilities": lambda family, config, layer: (
            f"causal: {causal_lm}, is_decoder=True"
            if family.score_function().causal(config)
            else "bidirectional: every query sees every key that is not padding"
        )
    }
    return type(
        name,
        (family,),
        {
            "__doc__": f"{summary}: {family.__doc__}",
            "__module__": __name__,
            "model_types": (model_type,),
            "layers": f"{base}.encoder.layer",
            "embed_tokens": f"{base}.embeddings.word_embeddings",
            "tiny": Tiny(config, causal_lm, Bert.tiny.kwargs),
            "vllm": VLLMLayout(refusal=NOT_MEASURED.format(name=summary)),
            "kind_notes": {"*": {**probabilities, **notes.get("*", {})}},
            **own,
        },
    )


class PreNormOwnAttention(OwnAttention, PreNormBert):
    """A pre-norm BERT block whose attention computes itself (Megatron-BERT)."""


MegatronBert = prenorm_shaped(
    "MegatronBert",
    "megatron-bert",
    "bert",
    "MegatronBertConfig",
    "MegatronBertForCausalLM",
    "Megatron-BERT",
    PreNormOwnAttention,
    attention_norm="attention.ln",
    mlp_norm="ln",
    final_norm="bert.encoder.ln",
    padding_changes_values="positions count from the padded start: Megatron-BERT's position ids take no mask",
    kind_notes={
        "*": {
            "layer_input": lambda family, config, layer: (
                "word + token type + position embeddings, not normalised (Megatron-BERT moved BERT's embedding "
                "LayerNorm into the blocks)"
                if layer == 0
                else None
            ),
            "attention_scores": "(queries @ keys^T) / sqrt(head_dim), masked: the softmax's argument",
            "final_norm_output": "bert.encoder.ln(the last block's layer_output): the encoder's last_hidden_state "
            "(and the last of transformers' hidden_states)",
        }
    },
)

RobertaPreLayerNorm = prenorm_shaped(
    "RobertaPreLayerNorm",
    "roberta-prelayernorm",
    "roberta_prelayernorm",
    "RobertaPreLayerNormConfig",
    "RobertaPreLayerNormForCausalLM",
    "RoBERTa-PreLayerNorm",
    attention_norm="attention.LayerNorm",
    mlp_norm="intermediate.LayerNorm",
    mlp_reads="intermediate.dense",
    Identities=NormInIntermediate,
    final_norm="roberta_prelayernorm.LayerNorm",
    kind_notes={
        "*": {
            "layer_input": lambda family, config, layer: (
                "LayerNorm(word + token type + position embeddings): the embeddings keep RoBERTa's norm"
                if layer == 0
                else None
            ),
            "mlp_norm_output": "intermediate.LayerNorm(layer_mid): the norm is the first step of intermediate's "
            "forward; what intermediate.dense receives",
            "mlp_input": "what intermediate.dense receives (intermediate itself receives layer_mid and normalises it)",
            "final_norm_output": "roberta_prelayernorm.LayerNorm(the last block's layer_output), applied by the base "
            "model after its encoder: its last_hidden_state",
        }
    },
)

XLMRobertaXL = prenorm_shaped(
    "XLMRobertaXL",
    "xlm-roberta-xl",
    "roberta",
    "XLMRobertaXLConfig",
    "XLMRobertaXLForCausalLM",
    "XLM-RoBERTa-XL",
    attention_norm="attention.self_attn_layer_norm",
    mlp_norm="LayerNorm",
    final_norm="roberta.encoder.LayerNorm",
    kind_notes={
        "*": {
            "layer_input": lambda family, config, layer: (
                "word + token type + position embeddings, not normalised (XLM-RoBERTa-XL has no embedding norm)"
                if layer == 0
                else None
            ),
            "final_norm_output": "roberta.encoder.LayerNorm(the last block's layer_output): the encoder's "
            "last_hidden_state",
        }
    },
)


class Esm(PreNormBert):
    """ESM: a pre-norm BERT block whose attention scales the queries by 1/sqrt(head_dim) before the attention
    interface (which then scales by 1), with rotary positions on the scaled queries and the keys where
    `config.position_embedding_type` is "rotary", learned absolute ones added to the embeddings by default."""

    model_types = ("esm",)
    vllm = encoder_on_vllm("ESM")
    # no causal LM in transformers: an encoder, served through StandardizedEncoder
    tiny = Tiny(
        "EsmConfig",
        "EsmForMaskedLM",
        {"num_key_value_heads": None},
        layouts={"rotary": {"position_embedding_type": "rotary"}},
    )
    layers = "esm.encoder.layer"
    embed_tokens = "esm.embeddings.word_embeddings"
    attention_norm = "attention.LayerNorm"
    mlp_norm = "LayerNorm"
    final_norm = "esm.encoder.emb_layer_norm_after"
    padding_changes_values = (
        "with rotary positions (position_embedding_type='rotary') the positions count from the padded start: "
        "EsmModel's rotary position ids take no mask"
    )

    kind_reasons = {"*": dict.fromkeys(CACHE_VALUES, "ESM keeps no KV cache: its attention takes none")}

    kind_notes = {
        "*": {
            "attention_queries": lambda family, config, layer: (
                "scaled by 1/sqrt(head_dim) (ESM scales the queries, and the attention interface by 1), "
                + (
                    "then rotated by the rotary embedding (position_embedding_type='rotary')"
                    if _rotary(config)
                    else "no rotary embedding: absolute positions were added to the embeddings "
                    "(position_embedding_type='absolute')"
                )
            ),
            "attention_keys": lambda family, config, layer: (
                "rotated by the rotary embedding (position_embedding_type='rotary')"
                if _rotary(config)
                else "no rotary embedding (position_embedding_type='absolute')"
            ),
            "attention_scores": "queries @ keys^T (the queries carry the 1/sqrt(head_dim)), masked: the softmax's "
            "argument",
            "layer_input": lambda family, config, layer: (
                "the word embeddings"
                + (" + learned absolute position embeddings" if not _rotary(config) else "")
                + (", LayerNorm-ed (emb_layer_norm_before)" if getattr(config, "emb_layer_norm_before", None) else "")
                + ", times the attention mask (padding rows zeroed): EsmEmbeddings' output"
                if layer == 0
                else None
            ),
            "final_norm_output": "esm.encoder.emb_layer_norm_after(the last block's layer_output): the encoder's "
            "last_hidden_state, what the LM head reads",
            "attention_probabilities": lambda family, config, layer: (
                "causal: is_decoder=True"
                if family.score_function().causal(config)
                else "bidirectional: every query sees every key that is not padding"
            ),
        }
    }


RoFormer = prenorm_shaped(
    "RoFormer",
    "roformer",
    "roformer",
    "RoFormerConfig",
    "RoFormerForCausalLM",
    "RoFormer",
    OwnAttention,
    padding_changes_values="positions count from the padded start: RoFormer's rotary positions take no mask",
    kind_notes={
        "*": {
            "attention_queries": "rotated by RoFormer's rotary embedding (sinusoidal, over interleaved pairs of each "
            "head's dimensions), as the scores' product receives them",
            "attention_keys": "rotated by the same rotary embedding as the queries, as the scores' product receives "
            "them (transposed back to [batch, heads, key, head_dim])",
            "attention_values": lambda family, config, layer: (
                "rotated by the rotary embedding too (config.rotary_value)"
                if getattr(config, "rotary_value", False)
                else None
            ),
            "attention_scores": "(queries @ keys^T) / sqrt(head_dim), masked: the softmax's argument",
            "layer_input": lambda family, config, layer: (
                "LayerNorm(word + token type embeddings): no position embeddings (positions enter the attention by "
                "rotation)"
                if layer == 0
                else None
            ),
        }
    },
)
RoFormer.__doc__ = (
    "RoFormer: BERT's post-norm block (the LayerNorms after each residual add) with rotary positions applied to the "
    "queries and keys inside an attention that computes itself."
)
