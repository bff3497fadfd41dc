"""GIT: a BERT-style post-norm decoder (`git.encoder.layer`) over text, causal, with a vision tower for images.

On token ids alone GIT is a causal text LM: `GitEmbeddings` adds learned position embeddings to the word embeddings
and normalises them, then each `GitLayer` runs `attention` (a `GitAttention`, renamed `self_attn`: `self`, which
computes attention itself, then `output`: `LayerNorm(dense(heads merged) + layer_input)`) and its MLP
(`intermediate`: dense and activation; `output`, renamed `mlp`: `LayerNorm(dense(activation) + stream)`). Every norm
follows a residual add, so, as on OPT's post-norm layout, `attention_norm_output`, `layer_mid` and `mlp_norm_output`
are unavailable with the reason, and there is no final norm (the LM head reads the last block's output).

nnsight mounts the `output` submodules at `E_output` (`.output` is the module's output on every envoy). With
`pixel_values` GIT prepends the image's tokens to the text, and they attend each other both ways: the attention values
then span image and text positions and the family's causal score function no longer describes the mask, so attnlens
serves GIT on token ids alone (support() says so).
"""

from __future__ import annotations

from ..family import EagerFunction, Family, Tiny, VLLMLayout
from ..locations import Derived, ModuleInput, ModuleOutput, Operation, OutputField
from ..locations.views import snapshot
from ..parts import identities
from ..parts.sizes import Sizes
from ..parts.vllm import backend_refuses

POST_NORM = "GIT normalises after each residual add, not before a sublayer: {what}"
TEXT_ONLY = (
    "on token ids alone: causal over the text. With pixel_values GIT prepends the image's tokens, which "
    "attend each other both ways; attnlens's mask and positions describe token ids only"
)


def _keys(envoy, transposed):
    return transposed.transpose(-1, -2)


def _untranspose(envoy, old, new):
    return new.transpose(-1, -2)


class Git(Family):
    refuses_images = (
        "GIT prepends the image's tokens to the text (they are not in input_ids), and they attend each other "
        "both ways, which the family's causal mask does not describe"
    )

    model_types = ("git",)
    vllm = VLLMLayout(
        refusal=backend_refuses(
            "GIT",
            "KeyError: 'vllm'",
            why="GitAttention picks its self-attention class from GIT_SELF_ATTENTION_CLASSES by the attention "
            "implementation, and vLLM's is not one of them",
        )
    )
    tiny = Tiny(
        "GitConfig",
        "GitForCausalLM",
        {
            "num_key_value_heads": None,
            "vision_config": {
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 64,
                "image_size": 32,
                "patch_size": 16,
            },
        },
    )
    layers = "git.encoder.layer"
    embed_tokens = "git.embeddings.word_embeddings"
    final_norm = None
    attention = "attention"
    mlp = "output"
    output_projection = "E_output.dense"
    down_projection = "dense"
    eager = EagerFunction(
        only=()
    )  # GitSelfAttention is GIT's only attention: it always forms the scores and the pattern
    padding_changes_values = "positions count from the padded start: GIT's position embeddings take no mask"
    sizes = Sizes(
        num_heads=("self.num_attention_heads",),
        head_dim=("self.attention_head_size",),
        scale=(lambda module, found: found["head_dim"] ** -0.5,),
    )

    def renames(self, engine="transformers"):
        from transformers.models.git import modeling_git as git

        # by class: `output` names the MLP's last module, the attention's projection module and the LM head
        return {self.layers: "layers", git.GitAttention: "self_attn", git.GitOutput: "mlp"}

    def locations(self):
        inner = dict(module="self")
        return {
            # GitEmbeddings adds the position embeddings into word_embeddings' output in place: served as a copy
            "embeddings": snapshot(
                ModuleOutput(self.embed_tokens),
                "GitEmbeddings adds the position embeddings into word_embeddings' output in place, "
                "so attnlens hands out a copy taken before that add",
            ),
            "layer_input": ModuleInput(),
            "attention_queries": Operation(("query_layer_0",), anchor="transpose", **inner),
            "attention_keys": Derived(
                Operation(("key_layer_transpose_0",), anchor="matmul", **inner), _keys, _untranspose, "attention_keys"
            ),
            "attention_scores": Operation(("attention_scores_2",), anchor="+ attention_mask", **inner),
            "attention_probabilities": Operation(("attention_probs_1",), anchor="dropout", **inner),
            # the values as the pattern mixes them (after any cache update): read after the pattern
            "attention_values": Operation(("torch_matmul_1",), "arg", 1, anchor="value_layer", **inner),
            "attention_head_outputs": Operation(("context_layer_1",), anchor="permute", **inner),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput(self.output_projection),
            "mlp_input": ModuleInput("intermediate"),
            "mlp_activation": ModuleInput(),  # GitOutput receives the activation's output itself
            "mlp_neurons": ModuleInput(self.down_projection),
            "mlp_output": ModuleOutput(self.down_projection),
            "layer_output": ModuleOutput(""),
            "logits": OutputField("logits"),
        }

    class Identities(identities.Identities):
        def project_output(self, module, premix):
            return module.output.dense(premix)

        def mlp_module(self, block):
            return identities.IntermediateMLP(block)

        def residual_add(self, block, sublayer, stream, update):
            """Post-norm: the stream after a sublayer is the norm of the sum (the attention's `output.LayerNorm`, the
            block's `output.LayerNorm`)."""
            norm = block.attention.output.LayerNorm if sublayer == "attention" else block.output.LayerNorm
            return norm(stream + update)

    kind_reasons = {
        "*": {
            "attention_norm_output": POST_NORM.format(what="the attention reads the block input itself"),
            "layer_mid": POST_NORM.format(
                what="the stream entering the MLP is attention.output.LayerNorm(layer_input "
                "+ attention_output) (mlp_input), and no norm precedes the MLP"
            ),
            "mlp_norm_output": POST_NORM.format(what="no norm precedes the MLP (output.LayerNorm follows it)"),
            "final_norm_output": "GIT has no final norm: the LM head (output) reads the last block's output, which "
            "ends in that block's own LayerNorm",
        }
    }

    kind_notes = {
        "*": {
            "attention_queries": "no rotary embedding: positions were added to the embeddings",
            "attention_scores": "(queries @ keys^T) / sqrt(head_dim), masked; " + TEXT_ONLY,
            "attention_probabilities": TEXT_ONLY,
            "attention_output": "attention.output.dense's output (its dropout, the identity in eval, follows); the "
            "stream after it is attention.output.LayerNorm(layer_input + attention_output)",
            "mlp_input": "what intermediate receives: attention.output.LayerNorm(layer_input + attention_output)",
            "mlp_activation": "intermediate's output, read as what output (renamed mlp) receives: the same tensor",
            "mlp_neurons": "what output.dense receives, equal to mlp_activation (no gate)",
            "mlp_output": "output.dense's output (its dropout, the identity in eval, follows); layer_output is "
            "output.LayerNorm(mlp_input + mlp_output)",
            "embeddings": "word_embeddings' output, a copy taken before GitEmbeddings adds the position embeddings "
            "into it in place",
            "layer_input": lambda family, config, layer: (
                "LayerNorm(word + learned position embeddings): GitEmbeddings' output" if layer == 0 else None
            ),
        }
    }
