"""Mllama (Llama 3.2 Vision), on text: Llama's self-attention blocks, with cross-attention blocks between them that run
only beside image features.

The layers listed in `config.cross_attention_layers` are cross-attention blocks: they attend from the text to the
vision tower's states (`cross_attention_states`) through tanh-gated residuals, and `MllamaTextModel` skips them
entirely when no such states are given (text alone) or cached. attnlens serves the self-attention blocks, which are
Llama's; on a cross-attention block every value is unavailable (nothing of it runs on text, and its keys and values are
image features, not positions of the sequence), and the residual stream passes it by: the next self-attention block's
`layer_input` is the previous one's `layer_output`. On those blocks `self_attn` is the cross-attention module
(`cross_attn`, renamed). The family serves the text model `AutoModelForCausalLM` builds
(`MllamaForCausalLM`, blocks at `model.layers`).
"""

from ..family import Tiny, VLLMLayout
from ..parts.vllm import backend_refuses
from ..values import ALL_VALUES
from .llama import Llama

CROSS = (
    "layer {layer} of Mllama is a cross-attention block (config.cross_attention_layers): it attends from the text "
    "to the vision tower's states and runs only when cross_attention_states are given or cached; on text alone the "
    "model skips it, and attnlens serves the self-attention blocks only"
)


class Mllama(Llama):
    model_types = ("mllama", "mllama_text_model")
    tiny = Tiny("MllamaTextConfig", "MllamaForCausalLM", {"cross_attention_layers": [1]})
    vllm = VLLMLayout(
        refusal=backend_refuses(
            "Mllama",
            "Unrecognized configuration class <class 'transformers.models.mllama.configuration_mllama."
            "MllamaTextConfig'> for this kind of AutoModel: AutoModel.",
            dropped=("MllamaForConditionalGeneration", "0.10.2"),
            why="the text model's checkpoint, mllama_text_model; a whole mllama checkpoint it runs only as a "
            "multimodal model (TransformersMultiModalForCausalLM), which builds Mllama's processor (\"Can't load image "
            'processor" from the tiny checkpoint; with a MllamaImageProcessor saved beside it its greedy tokens '
            "equal transformers'), whose locations inside vLLM's wrapper attnlens has not checked",
        )
    )

    def renames(self, engine="transformers"):
        return {**super().renames(engine), "cross_attn": "self_attn"}  # so layers[i].self_attn exists on every block

    @staticmethod
    def cross_attention_block(config, layer: int) -> bool:
        return layer in (config.get_text_config(decoder=True).cross_attention_layers or [])

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind | {"cross"} if self.cross_attention_block(config, layer) else kind

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "cross" in kind:  # only the model's own values (layer None reads as layer 0) stay
            locations = {
                name: location
                for name, location in locations.items()
                if name in ("embeddings", "final_norm_output", "logits")
            }
        return locations

    kind_reasons = {"cross": {value.name: CROSS for value in ALL_VALUES if value.scope != "model"}}
