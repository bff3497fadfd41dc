"""Granite MoE SWA: Granite MoE Shared's block (experts beside an optional shared MLP) with Granite SWA's sliding
windows and sinks applied after the mix (served as `attention_gate`, see `granite_swa.py`)."""

from dataclasses import replace

from ..family import Tiny
from .granite_swa import SinkScale
from .granitemoeshared import GraniteMoeShared


class GraniteMoeSWA(SinkScale, GraniteMoeShared):
    model_types = ("granitemoe_swa",)
    tiny = Tiny(
        "GraniteMoeSWAConfig",
        "GraniteMoeSWAForCausalLM",
        {
            **GraniteMoeShared.tiny[2],
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        layouts=GraniteMoeShared.tiny.layouts,
    )
    absent = {**GraniteMoeShared.absent, **SinkScale.absent}
    vllm = replace(
        SinkScale.vllm,
        model_types=("granitemoe_swa",),  # vLLM's GraniteMoeShared class
        tiny=GraniteMoeShared.vllm.tiny,
    )
