"""Moshi's text decoder (`MoshiForCausalLM`): the Llama layout with a gated MLP that splits `fc1` in halves, and a
configured `sliding_window` the attention mask does not apply.

`MoshiModel` builds its mask with `create_causal_mask`, so on a prefill every query sees every earlier key however
long the context: the pattern is full causal, and the family says so (no window). The window reaches the forward only
through the cache: `DynamicCache` built from the config keeps the last `sliding_window` keys per layer, so under
generate a step past the window attends to those only. The MLP is `fc2(activation_fn(a) * b)` with `a, b` the two
halves of `fc1(x)` (viewed as `[batch, seq, 2, ffn_dim // 2]`): `mlp_activation` is `activation_fn(a)`, `mlp_neurons`
what `fc2` receives.
"""

from ..family import Family, MLPArithmetic, Tiny, VLLMLayout
from ..parts import identities, scoring
from ..parts.vllm import computes_otherwise


class Moshi(Family):
    model_types = ("moshi",)
    vllm = VLLMLayout(
        refusal=computes_otherwise(
            "Moshi",
            "on the tiny checkpoint (TransformersForCausalLM, head size 32) its first greedy token already differs "
            "from transformers', log-probabilities 5.18 apart",
        )
    )
    tiny = Tiny(
        "MoshiConfig",
        "MoshiForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 4,
            "ffn_dim": 128,
            "audio_encoder_config": {
                "model_type": "mimi",
                "num_hidden_layers": 1,
                "hidden_size": 32,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "intermediate_size": 64,
                "head_dim": 16,
                "sliding_window": 4,
            },
            "depth_decoder_config": {
                "model_type": "moshi_depth",
                "num_hidden_layers": 1,
                "hidden_size": 32,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "vocab_size": 128,
                "head_dim": 16,
                "sliding_window": 4,
                "ffn_dim": 128,
                "audio_vocab_size": 2048,
                "input_size": 64,
                "num_codebooks": 8,
            },
        },
    )
    activation = "activation_fn"
    down_projection = "fc2"

    class Identities(identities.Identities):
        def mlp_arithmetic(self, mlp):
            def halves(x):
                projected = mlp.fc1(x)
                return projected.view(*projected.shape[:2], 2, -1)

            return MLPArithmetic(
                lambda neurons: mlp.fc2(neurons),
                lambda x: halves(x)[..., 0, :],
                lambda z: mlp.activation_fn(z),
                lambda x, activation: activation * halves(x)[..., 1, :],
                says=("first half of fc1(mlp input)", "activation * second half of fc1(mlp input)", "fc2(neurons)"),
            )

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            return None  # the mask is create_causal_mask's: full causal on a prefill

    kind_notes = {
        "*": {
            "attention_probabilities": "full causal on a prefill: the mask ignores config.sliding_window "
            "({config.sliding_window}); under generate the cache keeps only the last {config.sliding_window} keys",
            "mlp_activation": "activation_fn(a), a the first half of fc1(x)",
            "mlp_neurons": "what fc2 receives: activation_fn(a) * b, the halves of fc1(x)",
        }
    }
