"""ALBERT: a post-norm, bidirectional encoder whose blocks are shared: a few `AlbertLayer` modules, each run many times.

`AlbertTransformer.forward` first maps the factorised embeddings up (`embedding_hidden_mapping_in`: embedding_size ->
hidden_size), then runs, for each of `num_hidden_layers` steps, the group `albert_layer_groups[g]` (g =
`int(step / (num_hidden_layers / num_hidden_groups))`), which runs its `inner_group_num` layers `albert_layers[j]` in
turn. With the released checkpoints' `num_hidden_groups = inner_group_num = 1`, one module runs num_hidden_layers
times.

**What `layers[i]` is.** The i-th *application*: the i-th call of an `AlbertLayer` in the forward (step `i //
inner_group_num`, layer `i % inner_group_num` of that step's group), as transformers counts its `output_attentions`
and `output_hidden_states`; `num_layers` is num_hidden_layers x inner_group_num. Every read and write on `layers[i]`
(the standardized values, and nnsight's own `.output`, `.input`, `.source`) binds to that call only (the family's
`applications`, `attnlens.applications`): an edit of `layers[1]`'s pattern changes application 1 and, through the
stream, every later one, never application 0. The weights are the module's, shared: an edit of a weight (`layers[i]
._module`, or the module itself) moves every application that runs it.

Each `AlbertLayer` runs `attention` (an `AlbertAttention`, renamed `self_attn`: query, key and value projections,
transformers' attention interface with BERT's eager function, `dense`, then `LayerNorm(layer_input + dense(heads
merged))` inside the attention module), then `ffn`, `activation` and `ffn_output`, which the block calls itself
(`ff_chunk`; `ffn_output` is renamed `mlp`, as BART's `fc2`), and `full_layer_layer_norm(ffn_output +
attention's output)`. Post-norm, as BERT: no `attention_norm_output`, `layer_mid` is what the attention's LayerNorm
receives, `mlp_norm_output` its output, no final norm.
"""

from __future__ import annotations

from ..family import Family, Tiny
from ..locations import ModuleInput, ModuleOutput
from ..parts import identities, scoring
from ..parts.sizes import Sizes
from ..parts.vllm import encoder_on_vllm
from .bert import post_norm_locations

POST_NORM = "ALBERT normalises after each residual add, not before a sublayer: {what}"
SHARED = (
    "application {layer} of the shared AlbertLayer {path} (call {call} of it; layers[i] is the i-th AlbertLayer call, "
    "as output_attentions counts them): its weights are shared, so an edit of one moves every application"
)


def applications(config, encoder: str = "albert.encoder") -> tuple[str, ...]:
    """The module path of the `AlbertLayer` each call runs, in forward order (what `AlbertTransformer.forward`
    indexes: the group of step i, then each of its inner layers), under the `AlbertTransformer` at `encoder`."""
    steps, groups = config.num_hidden_layers, config.num_hidden_groups
    return tuple(
        f"{encoder}.albert_layer_groups.{int(step / (steps / groups))}.albert_layers.{inner}"
        for step in range(steps)
        for inner in range(config.inner_group_num)
    )


def shared_note(family, config, layer):
    paths = family.applications(config)
    return SHARED.format(layer=layer, path=paths[layer], call=paths[:layer].count(paths[layer]))


class Albert(Family):
    model_types = ("albert",)
    vllm = encoder_on_vllm("ALBERT")
    tiny = Tiny(
        "AlbertConfig",
        "AlbertForMaskedLM",
        {"embedding_size": 32, "initializer_range": 0.2, "num_key_value_heads": None},
    )
    layers = "albert.encoder.albert_layer_groups.0.albert_layers"  # the first group's; `applications` lists the runs
    embed_tokens = "albert.embeddings.word_embeddings"
    final_norm = None
    attention = "attention"
    attention_norm = None
    mlp_norm = "attention.LayerNorm"
    mlp = "ffn_output"  # no MLP module: its last step carries the MLP's values (renamed `mlp`)
    activation = "activation"
    output_projection = "dense"
    down_projection = "ffn_output"  # on the block, which runs the MLP (see `mlp_module`)
    padding_changes_values = "positions count from the padded start: ALBERT's position ids take no mask"
    sizes = Sizes(num_heads=("num_attention_heads",), head_dim=("attention_head_size",), scale=("scaling",))
    ScoreFunction = scoring.Bidirectional

    def applications(self, config):
        # under the head model's `albert`, or at the top of a bare AlbertModel (`layers` rebased at load)
        return applications(config, self.layers.partition(".albert_layer_groups.")[0])

    def locations(self):
        return post_norm_locations(
            super().locations(),
            attention_output=ModuleOutput(self.output_projection),
            mlp_input=ModuleInput("ffn"),
            mlp_activation=ModuleInput(),  # ffn_output receives the activation's output itself
            mlp_neurons=ModuleInput(),
        )

    class Identities(identities.Identities):
        def project_output(self, module, premix):
            return module.dense(premix)

        def mlp_module(self, block):
            return block  # the block calls ffn, activation and ffn_output itself (ff_chunk)

        def mlp_forward(self, block, mlp_input, **arguments):
            return block.ff_chunk(mlp_input)

        def residual_add(self, block, sublayer, stream, update, **arguments):
            """Post-norm: the attention's update joins the block input before the attention's LayerNorm
            (`layer_mid`); the MLP's joins the normalised stream, and the block's `full_layer_layer_norm` follows."""
            if sublayer == "attention":
                return stream + update
            return block.full_layer_layer_norm(block.attention.LayerNorm(stream) + update)

    kind_reasons = {
        "*": {
            "attention_norm_output": POST_NORM.format(what="the attention reads the block input itself"),
            "final_norm_output": "ALBERT has no final norm: its heads read the last block's output, which ends in "
            "that block's own full_layer_layer_norm",
        }
    }

    kind_notes = {
        "*": {
            "embeddings": "the word embeddings' output, config.embedding_size wide (factorised): ALBERT adds the "
            "positions and token types, normalises, and maps the sum to hidden_size (encoder."
            "embedding_hidden_mapping_in) before layers[0]",
            "layer_input": lambda family, config, layer: (
                "encoder.embedding_hidden_mapping_in(LayerNorm(word + token type + position embeddings)): the "
                "factorised embeddings mapped to hidden_size; " + shared_note(family, config, layer)
                if layer == 0
                else shared_note(family, config, layer)
            ),
            "attention_queries": "no rotary embedding: positions were added to the embeddings",
            "attention_probabilities": "bidirectional: every query sees every key that is not padding",
            "attention_output": "attention.dense's output (before its dropout, the identity in eval, and the "
            "attention's LayerNorm)",
            "layer_mid": "layer_input + attention_output, what attention.LayerNorm receives (post-norm)",
            "mlp_norm_output": "attention.LayerNorm(layer_mid), the attention module's output: the MLP's input and "
            "the stream its output joins",
            "mlp_activation": "activation's output, read as what ffn_output (renamed mlp) receives: the same tensor",
            "mlp_neurons": "what ffn_output receives, equal to mlp_activation (no gate)",
            "layer_output": "full_layer_layer_norm(mlp_output + mlp_norm_output): post-norm",
        }
    }
