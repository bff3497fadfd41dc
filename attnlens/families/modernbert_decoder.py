"""ModernBERT-decoder: ModernBERT's names on a causal decoder, sliding and global layers, a normalised embedding, and
a prediction head before the vocabulary projection.

Each block runs `attn_norm` (the identity on layer 0, whose input is already normalised), the attention (`attn`,
renamed `self_attn`; the common attention interface, output projection `Wo`), then `mlp_norm` and a GLU MLP:
`Wo(act(a) * b)` with `a, b` the halves of `Wi(x)`. `embeddings` is the token embedding module's output
(`model.embeddings.tok_embeddings`); `model.embeddings` normalises it before `layers[0]`. `logits` are
`decoder(lm_head(final_norm_output))`, `lm_head` being a dense layer, activation and norm.
"""

from ..family import Family

CHUNKED = ("ModernBERT's MLP applies its activation to one half of Wi's output and multiplies it by the other half; "
           "attnlens serves what Wo receives (mlp_neurons), not the activation alone, whose identity it checks "
           "against gate_proj/up_proj names this MLP does not have")


class ModernBertDecoder(Family):
    model_types = ("modernbert-decoder",)
    tiny = ("ModernBertDecoderConfig", "ModernBertDecoderForCausalLM", {
        "num_key_value_heads": None, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]})
    embed_tokens = "model.embeddings.tok_embeddings"
    final_norm = "model.final_norm"
    attention = "attn"
    attention_norm = "attn_norm"
    mlp_norm = "mlp_norm"
    output_projection = "Wo"
    activation = "act"
    down_projection = "Wo"
    absent = {**Family.absent, "mlp_activation": CHUNKED}

    def locations(self):
        locations = super().locations()
        del locations["mlp_activation"]
        return locations

    def num_kv_heads(self, module):
        return module.num_heads  # every head has its own keys and values

    def notes(self, config, layer, engine="eager"):
        notes = {**super().notes(config, layer, engine),
                 "embeddings": "the token embedding's output; model.embeddings normalises it before layers[0]",
                 "mlp_neurons": "what Wo receives: act(a) * b, the halves of Wi(x)",
                 "logits": "decoder(lm_head(final_norm_output)): lm_head is a dense layer, activation and norm"}
        if layer == 0:
            notes["attention_norm_output"] = "layer_input itself: layer 0's attn_norm is the identity"
        return notes
