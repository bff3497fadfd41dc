"""Hybrids whose other layers mix tokens without softmax attention: the layer kind they share.

A hybrid's blocks run either softmax attention or another token mixer (a Mamba state-space scan, a short
convolution, a linear recurrence) in the same place of an otherwise common block. attnlens renames that other mixer
to `self_attn`, so `layers[i].self_attn` exists on every layer; on a mixer layer it serves the mixer's output
(`attention_output`) and reports every value of a softmax attention (queries, keys, values, scores, pattern, sinks,
head outputs, gate, premix) unavailable with the reason. The blocks' residual stream, norms and MLPs are served on
every layer.
"""

from __future__ import annotations

from typing import ClassVar

from . import scoring

#: What a layer without softmax attention lacks (less what its mixer still serves, `MixerLayers.mixer_serves`).
NO_SOFTMAX = (
    "attention_queries",
    "attention_keys",
    "attention_values",
    "attention_key_positions",
    "attention_scores",
    "attention_probabilities",
    "attention_sinks",
    "attention_head_outputs",
    "attention_gate",
    "attention_premix",
)


class MixerLayers:
    """Mixin for a hybrid whose layers `is_mixer_layer` names run `mixer` (renamed `self_attn`) instead of softmax
    attention. `mixer_kind` says what the mixer is, for the reasons."""

    #: The other mixer's module name in its blocks.
    mixer = "mamba"
    #: What the mixer is: "a Mamba-2 layer: a selective state-space scan over a recurrent state".
    mixer_kind = "a Mamba layer: a selective state-space scan over a recurrent state"
    #: What its output projection receives, and why that is not a premix (None: it has none).
    mixer_premix = (
        "what its out_proj receives is the gated scan output, not attention heads merged (on the fused "
        "CUDA-kernel path it is never formed as a tensor)"
    )
    #: Whether the mixer is renamed `self_attn`; not where the block keeps a `self_attn = None` attribute on those
    #: layers (nnsight refuses an alias that shadows one), and then its output is not served either.
    mixer_renamed = True
    #: Values of NO_SOFTMAX the mixer still serves (a linear-attention layer's output projection receives its heads
    #: merged: `attention_premix`).
    mixer_serves: ClassVar[tuple[str, ...]] = ()

    @property
    def mixer_lacks(self) -> tuple[str, ...]:
        """What a mixer layer does not serve."""
        return tuple(name for name in NO_SOFTMAX if name not in self.mixer_serves)

    @staticmethod
    def text_config(config):
        return config.get_text_config(decoder=True)

    def is_mixer_layer(self, config, layer: int) -> bool:
        return self.text_config(config).layer_types[layer] not in ("full_attention", "sliding_attention")

    def renames(self, engine="transformers"):
        mixer = self.path("mixer", engine)  # vLLM may name it otherwise (`vllm.names`)
        if not self.mixer_renamed or mixer == "self_attn":  # nothing to rename, or already its name
            return super().renames(engine)
        return {**super().renames(engine), mixer: "self_attn"}

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind | {"mixer"} if self.is_mixer_layer(config, layer) else kind

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "mixer" in kind:
            dropped = self.mixer_lacks if self.mixer_renamed else (*self.mixer_lacks, "attention_output")
            locations = {name: location for name, location in locations.items() if name not in dropped}
        return locations

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            return None if self.family.is_mixer_layer(config, layer) else super().sliding_window(config, layer)

    def unavailable(self, config, layer, engine="transformers"):
        reasons = super().unavailable(config, layer, engine)
        if self.is_mixer_layer(config, layer):
            renamed = self.mixer_renamed and self.mixer != "self_attn"
            read_as = f"{self.mixer}, read as self_attn" if renamed else self.mixer
            what = (
                f"layer {layer} of {self.name} is {self.mixer_kind} ({read_as}), not softmax attention: it forms "
                f"no queries, keys or pattern"
            )
            for name in self.mixer_lacks:
                reasons[name] = what
            if self.mixer_premix and "attention_premix" in self.mixer_lacks:
                reasons["attention_premix"] = f"{what}; {self.mixer_premix}"
            reasons["attention_head_outputs"] = f"{what}, so no head mixes values by a pattern"
            if not self.mixer_renamed:
                reasons["attention_output"] = (
                    f"{what}; its output is layers[{layer}].{self.mixer}'s, which attnlens "
                    f"cannot name self_attn (the block keeps self_attn = None there): read "
                    f"it with nnsight as model.layers[{layer}].{self.mixer}.output"
                )
        return reasons

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if self.is_mixer_layer(config, layer):
            notes = {name: note for name, note in notes.items() if not name.startswith("attention_")}
            if self.mixer_renamed:
                notes["attention_output"] = f"{self.mixer}'s output: {self.mixer_kind}"
        return notes


class LinearLayers(MixerLayers):
    """Mixin for a hybrid whose `config.layer_types` "linear_attention" layers run linear attention (a recurrent state
    updated by a delta rule): mixer layers whose output projection still receives their heads merged."""

    mixer = "self_attn"
    mixer_kind = "a linear-attention layer: a recurrent state updated by a delta rule"
    mixer_premix = None
    mixer_serves = ("attention_premix",)

    def is_mixer_layer(self, config, layer: int) -> bool:
        return self.text_config(config).layer_types[layer] == "linear_attention"
