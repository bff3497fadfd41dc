import pytest
import torch
import transformers

import attnlens

CORE_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")


#: "model_type" or "model_type:layout", one per family and layout (see `Family.tiny_layouts`).
ALL_CASES = attnlens.models.tiny_cases()
# 18 characters: longer than the tiny sliding windows (4), so window rows are tested.
PROMPT = "Hello world, again"

_models: dict = {}


def tiny(family: str, **kwargs):
    """One tiny model per (family, options) for the whole session; tests must not leave edits behind. Skips where the
    installed transformers lacks the family's config class (a type newer than it)."""
    recipe = attnlens.registered()[family.partition(":")[0]].tiny
    if recipe is not None and not hasattr(transformers, recipe[0]):
        pytest.skip(f"transformers {transformers.__version__} has no {recipe[0]}")
    key = (family, tuple(sorted(kwargs.items())))
    if key not in _models:
        _models[key] = attnlens.models.tiny(family, **kwargs)
    return _models[key]


@pytest.fixture(params=CORE_FAMILIES)
def family(request):
    return request.param


@pytest.fixture(autouse=True)
def _no_grad_leak():
    torch.set_grad_enabled(True)
    yield
