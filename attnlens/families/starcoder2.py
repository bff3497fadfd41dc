"""Starcoder2: biased projections, LayerNorms, a sliding window on every layer (through the mask), a plain
(ungated) `c_fc -> act -> c_proj` MLP, and residual dropout on both sublayer outputs.

`attention_output` and `mlp_output` are the sublayer outputs after their residual dropout (`config.residual_dropout`,
active only in training); `embeddings` is the token embedding before `config.embedding_dropout`. In eval mode both
dropouts are the identity.
"""

from ..family import Tiny
from ..parts.mirrored import transformers_backend
from .mistral import Mistral

DROPOUT = "after the residual dropout (p=config.residual_dropout, active only in training)"


class Starcoder2(Mistral):
    model_types = ("starcoder2",)
    vllm = transformers_backend(("starcoder2",))
    # Dropouts set so that the identities would catch them acting outside training.
    tiny = Tiny(
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        {"sliding_window": 4, "residual_dropout": 0.1, "embedding_dropout": 0.1},
    )
    activation = "act"
    down_projection = "c_proj"

    kind_notes = {
        "*": {
            "attention_output": f"o_proj's output {DROPOUT}",
            "mlp_output": f"c_proj's output {DROPOUT}",
        }
    }
