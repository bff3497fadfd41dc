"""ModernBERT-decoder: ModernBERT's names on a causal decoder, sliding and global layers, a normalised embedding, and
a prediction head before the vocabulary projection.

Each block runs `attn_norm` (the identity on layer 0, whose input is already normalised), the attention (`attn`,
renamed `self_attn`; the common attention interface, output projection `Wo`), then `mlp_norm` and a GLU MLP:
`Wo(drop(act(a) * b))` with `a, b` the halves of `Wi(x)` (`drop` is a dropout, the identity in eval mode):
`mlp_activation` is `act(a)`, `mlp_neurons` what `Wo` receives. `embeddings` is the token embedding module's output
(`model.embeddings.tok_embeddings`); `model.embeddings` normalises it before `layers[0]`. `logits` are
`decoder(lm_head(final_norm_output))`, `lm_head` being a dense layer, activation and norm.
"""

from ..family import Family, MLPArithmetic, Tiny, VLLMLayout
from ..parts import identities
from ..parts.sizes import Sizes


class ModernBertDecoder(Family):
    model_types = ("modernbert-decoder",)
    vllm = VLLMLayout(
        refusal="vLLM 0.32 has no class for ModernBertDecoderForCausalLM, and its Transformers backend cannot load "
        "the checkpoint: \"There is no module or parameter named 'decoder' in TransformersForCausalLM\" (the LM head "
        "is named decoder); the transformers engine serves the family",
    )
    tiny = Tiny(
        "ModernBertDecoderConfig",
        "ModernBertDecoderForCausalLM",
        {
            "num_key_value_heads": None,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
    )
    embed_tokens = "model.embeddings.tok_embeddings"
    final_norm = "model.final_norm"
    attention = "attn"
    attention_norm = "attn_norm"
    mlp_norm = "mlp_norm"
    output_projection = "Wo"
    activation = "act"
    down_projection = "Wo"
    sizes = Sizes(num_kv_heads=("num_heads",))

    class Identities(identities.Identities):
        def mlp_arithmetic(self, mlp):
            def halves(x):
                return mlp.Wi(x).chunk(2, dim=-1)

            return MLPArithmetic(
                lambda neurons: mlp.Wo(neurons),
                lambda x: halves(x)[0],
                lambda z: mlp.act(z),
                lambda x, activation: mlp.drop(activation * halves(x)[1]),
                says=("first half of Wi(mlp input)", "drop(activation * second half of Wi(mlp input))", "Wo(neurons)"),
            )

    kind_notes = {
        "*": {
            "embeddings": "the token embedding's output; model.embeddings normalises it before layers[0]",
            "mlp_activation": "act(a), a the first half of Wi(x)",
            "mlp_neurons": "what Wo receives: act(a) * b, the halves of Wi(x) (after drop, a dropout: the "
            "identity in eval mode)",
            "logits": "decoder(lm_head(final_norm_output)): lm_head is a dense layer, activation and norm",
            "attention_norm_output": lambda family, config, layer: (
                "layer_input itself: layer 0's attn_norm is the identity" if layer == 0 else None
            ),
        }
    }
