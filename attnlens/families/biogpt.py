"""BioGPT: BART-style names on a pre-norm decoder, learned positions, scaled embeddings, and an MLP the block runs
itself.

Attention reads `self_attn_layer_norm`'s output and uses the common attention interface with `out_proj`; the MLP's norm
is `final_layer_norm` (inside each block; the decoder's last norm is `biogpt.layer_norm`). The block has no MLP module:
it calls `fc1`, `activation_fn` and `fc2` itself, so `layers[i].mlp` is `fc2` (the MLP's last step: its input is the
activation's output, its output the MLP's). `embeddings` is the token embedding module's output, which already carries
`sqrt(hidden_size)` where `scale_embedding` is set; the learned positions are added after it.

vLLM runs it through its Transformers backend (transformers' own modules, vLLM's kernel as the attention function).
"""

from ..family import Family, Tiny
from ..locations import ModuleInput, ModuleOutput
from ..parts import identities
from ..parts.mirrored import transformers_backend


class BioGpt(Family):
    model_types = ("biogpt",)
    vllm = transformers_backend(("biogpt",), tiny={"hidden_size": 128})  # Transformers backend; head size 32
    tiny = Tiny("BioGptConfig", "BioGptForCausalLM", {"num_key_value_heads": None, "scale_embedding": True})
    layers = "biogpt.layers"
    embed_tokens = "biogpt.embed_tokens"
    final_norm = "biogpt.layer_norm"
    attention_norm = "self_attn_layer_norm"
    mlp_norm = "final_layer_norm"
    output_projection = "out_proj"
    mlp = "fc2"  # no MLP module: its last step carries the MLP's values (renamed `mlp`)
    activation = "activation_fn"
    down_projection = "fc2"  # on the block, which runs the MLP (see `mlp_module`)

    def locations(self):
        return {
            **super().locations(),
            "mlp_input": ModuleInput("fc1"),
            "mlp_activation": ModuleInput(),  # fc2 receives the activation's output itself (dropout is off)
            "mlp_neurons": ModuleInput(),
            "mlp_output": ModuleOutput(),
        }

    class Identities(identities.Identities):
        def mlp_module(self, block):
            return block  # the block calls fc1, activation_fn and fc2 itself

        def mlp_forward(self, block, mlp_input):
            return block.fc2(block.activation_fn(block.fc1(mlp_input)))

    kind_notes = {
        "*": {
            "mlp_activation": "what fc2 receives: activation_fn(fc1(x)), the same tensor as mlp_neurons (no gate)",
            "embeddings": "the scaled token embedding's output; learned positions are added before layers[0]",
        }
    }
