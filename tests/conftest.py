import os

import pytest
import torch
import transformers

import attnlens

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per worker: the workers already fill the cores, and torch's default team of a thread per core in
    # each worker spins against the others (the identity suite ran 6x slower on two workers of two threads each).
    torch.set_num_threads(1)

CORE_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")


#: "model_type" or "model_type:layout", one per family and layout (see `Family.tiny`: `attnlens.Tiny`).
ALL_CASES = attnlens.models.tiny_cases()
# 18 characters: longer than the tiny sliding windows (4), so window rows are tested.
PROMPT = "Hello world, again"

_models: dict = {}


def tiny(family: str, **kwargs):
    """One tiny model per (family, options) for the whole session; tests must not leave edits behind. Skips where the
    installed transformers lacks the family's config class (a type newer than it)."""
    reason = missing_classes(family)
    if reason:
        pytest.skip(reason)
    key = (family, tuple(sorted(kwargs.items())))
    if key not in _models:
        _models[key] = attnlens.models.tiny(family, **kwargs)
    return _models[key]


def missing_classes(case: str) -> str | None:
    """Why the installed transformers cannot build `case`'s tiny model (its config or model class is newer), or None."""
    recipe = attnlens.registered()[case.partition(":")[0]].tiny or ()
    missing = [name for name in recipe[:2] if not hasattr(transformers, name)]
    return f"transformers {transformers.__version__} has no {', '.join(missing)}" if missing else None


def needs(case: str) -> None:
    """Skip where the installed transformers lacks `case`'s classes (they are newer than it)."""
    reason = missing_classes(case)
    if reason:
        pytest.skip(reason)


def pytest_collection_modifyitems(items):
    """Cases whose model type the installed transformers lacks are skipped, saying so, wherever they are used."""
    for item in items:
        case = getattr(item, "callspec", None) and item.callspec.params.get("case")
        if isinstance(case, str) and case.partition(":")[0] in attnlens.registered():
            reason = missing_classes(case)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_sessionstart(session):
    """Under pytest-xdist (`-n`), the real checkpoints are converted here, once, before the workers start: two workers
    converting at once on a fresh machine would write the same cache folder (`attnlens.models.converted`)."""
    config = session.config
    parallel = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    if parallel and "not real" not in (config.option.markexpr or ""):
        attnlens.models.smollm2_path()
        attnlens.models.gemma3_270m_path()


@pytest.fixture(params=CORE_FAMILIES)
def family(request):
    return request.param


@pytest.fixture(autouse=True)
def _no_grad_leak():
    torch.set_grad_enabled(True)
    return
