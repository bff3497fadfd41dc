"""attnlens: one vocabulary for the inside of attention, on every model family."""

from importlib.metadata import version as _installed_version

from . import (
    import_order,  # noqa: F401  first: anyio's classes before nnsight's `.save` (import_order.py)
    models,
)
from .analysis import Attribution, LogitLens, PatchGrid, attribution, attribution_patching, logit_lens, patch
from .capture import Cache, attn_out_gate, capture_attention, per_head_value, run_with_cache, split_fused_qkv
from .collect import collect
from .editing import keep_masked, masked
from .errors import (
    AttnlensError,
    EditError,
    EngineStopped,
    InferredFamilyWarning,
    LocationDrift,
    Miswired,
    OrderError,
    OutsideTrace,
    Unavailable,
    UnknownFamily,
    UnknownFamilyWarning,
)
from .family import EagerFunction, EncoderDecoder, Family, Joined, MLPArithmetic, Tiny
from .geometry import HeadGeometry
from .heads import HeadSummaries, head_summaries
from .locations import Derived, Location, ModuleInput, ModuleOutput, Operation, OutputField
from .parts.fused import FusedQKV
from .parts.identities import Identities
from .parts.multimodal import AudioPositions, Positions
from .parts.scoring import ScoreFunction
from .parts.sizes import Sizes
from .parts.vllm import VLLMLayout
from .plot import plot
from .registry import family_for, register, registered
from .show import View, show
from .stacks import StandardizedSeq2Seq
from .standardized import StandardizedEncoder, StandardizedTransformer
from .support import Support
from .values import ALL_VALUES, Value

#: The installed release (pyproject.toml's version, read from the package's metadata).
__version__ = _installed_version("attnlens")


def __getattr__(name: str):
    # vLLM is optional and heavy: imported only when StandardizedVLLM is first asked for.
    if name == "StandardizedVLLM":
        from .vllm import StandardizedVLLM

        return StandardizedVLLM
    raise AttributeError(f"module 'attnlens' has no attribute {name!r}")


__all__ = [
    "ALL_VALUES",
    "AttnlensError",
    "Derived",
    "EagerFunction",
    "EditError",
    "EngineStopped",
    "Family",
    "Joined",
    "HeadGeometry",
    "Identities",
    "InferredFamilyWarning",
    "Location",
    "LocationDrift",
    "MLPArithmetic",
    "Miswired",
    "ModuleInput",
    "ModuleOutput",
    "Operation",
    "OutputField",
    "OrderError",
    "OutsideTrace",
    "AudioPositions",
    "Positions",
    "ScoreFunction",
    "Sizes",
    "Tiny",
    "VLLMLayout",
    "StandardizedTransformer",
    "StandardizedEncoder",
    "StandardizedSeq2Seq",
    "EncoderDecoder",
    "Support",
    "Unavailable",
    "UnknownFamily",
    "UnknownFamilyWarning",
    "Value",
    "family_for",
    "keep_masked",
    "masked",
    "models",
    "register",
    "registered",
    # capture (attnlens/capture/)
    "Cache",
    "FusedQKV",
    "attn_out_gate",
    "capture_attention",
    "per_head_value",
    "run_with_cache",
    "split_fused_qkv",
    # seeing and summarising (show.py, plot.py, heads.py)
    "HeadSummaries",
    "View",
    "head_summaries",
    "plot",
    "show",
    # analyses (attnlens/analysis/)
    "Attribution",
    "LogitLens",
    "PatchGrid",
    "attribution",
    "attribution_patching",
    "logit_lens",
    "patch",
    # corpus collection (attnlens/collect/)
    "collect",
]
