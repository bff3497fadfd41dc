"""CTRL: a pre-norm block under its own names, sinusoidal positions, and embeddings scaled in place.

Each block (`EncoderLayer`) runs `layernorm1`, the attention (`multi_head_attention`, renamed `self_attn`, the common
attention interface with `dense` as output projection), then `layernorm2` and a `Sequential` MLP (`ffn`: Linear,
ReLU, Linear). `CTRLModel` multiplies the token embedding's output by `sqrt(n_embd)` *in place* and adds the
sinusoidal positions, so `embeddings` is a snapshot of the embedding module's output taken before that.

vLLM runs it through its Transformers backend (transformers' own modules, vLLM's kernel as the attention function).
"""

from ..family import Family, Tiny
from ..locations import Derived, ModuleOutput
from ..parts.mirrored import transformers_backend
from ..parts.sizes import Sizes


def _snapshot(envoy, output):
    return output.clone()


def _replace(envoy, old, new):
    return new.clone()  # the model scales what it receives in place: never the caller's tensor


class CTRL(Family):
    model_types = ("ctrl",)
    vllm = transformers_backend(("ctrl",), tiny={"n_embd": 128})  # Transformers backend; head size 32
    tiny = Tiny(
        "CTRLConfig",
        "CTRLLMHeadModel",
        {
            "n_layer": 3,
            "n_embd": 64,
            "n_head": 4,
            "dff": 128,
            "n_positions": 128,
            "num_hidden_layers": None,
            "hidden_size": None,
            "num_attention_heads": None,
            "num_key_value_heads": None,
            "intermediate_size": None,
            "max_position_embeddings": None,
        },
    )
    layers = "transformer.h"
    embed_tokens = "transformer.w"
    final_norm = "transformer.layernorm"
    attention = "multi_head_attention"
    attention_norm = "layernorm1"
    mlp_norm = "layernorm2"
    mlp = "ffn"
    output_projection = "dense"
    activation = "1"  # the MLP is a Sequential: Linear, ReLU, Linear
    down_projection = "2"
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=("num_heads",))

    def locations(self):
        return {
            **super().locations(),
            "embeddings": Derived(
                ModuleOutput(self.embed_tokens),
                _snapshot,
                _replace,
                "embeddings",
                in_place=False,
                why_not="it is a snapshot: CTRLModel multiplies the embedding output by sqrt(n_embd) in place right "
                "after",
            ),
        }

    kind_notes = {
        "*": {
            "embeddings": "a snapshot of the token embedding's output (assign it; in-place edits cannot land): "
            "CTRLModel multiplies it by sqrt(n_embd) in place and adds sinusoidal positions before "
            "layers[0]",
        }
    }
