"""The causal-LM survey: every model type transformers maps to a causal LM, built tiny on CPU and looked inside.

    python -m attnlens.survey                    # regenerate docs/survey.json and docs/survey.md
    python -m attnlens.survey --json out.json    # the records for the installed transformers only
    python -m attnlens.survey llama gpt2         # those types only, printed

For each type: whether a tiny random model (float32, eager attention) builds and runs a forward on 8 token ids; which
of its layers run a softmax over positions (seen at run time) and how (the shared attention interface, or the
module's own arithmetic); what attnlens serves for it; and, where attnlens has no family, how the model differs from
the common layout (`attnlens.Family`), first statically (module and operation names) and then by running the common
layout's identities (`attnlens.checks`) on its attention layers. `docs/survey.md` explains the fields.

Each type is surveyed in a worker process (a crash or a hang costs that type only); two workers run side by side.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from .family import INTERFACE_CALL, TINY_DEFAULTS, Family

ROOT = Path(__file__).resolve().parent.parent
JSON_PATH = ROOT / "docs" / "survey.json"
MARKDOWN_PATH = ROOT / "docs" / "survey.md"
#: The other transformers attnlens supports, surveyed with its own interpreter (`make install-vllm` builds it).
OTHER_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SECONDS_PER_TYPE = 60
#: Show the workers' stderr (transformers' warnings, tracebacks of crashes).
VERBOSE = bool(os.environ.get("ATTNLENS_SURVEY_VERBOSE"))
TOKENS = torch.arange(3, 11)[None]  # 8 token ids, clear of pad/bos/eos
PROMPT = "Hello world!"  # 12 characters for the common-layout check: longer than the tiny sliding windows (4)

# --- how tiny models are built: data ---------------------------------------------------------------------------

#: Sizes a tiny model starts from, each set where the config class's default has the attribute with a value of the
#: same type (under any alias): attnlens's TINY_DEFAULTS, then the other names configs use for the same sizes.
SIZES = {
    **TINY_DEFAULTS, "head_dim": 16, "sliding_window": 4,
    "n_layer": 3, "n_layers": 3, "num_layers": 3, "decoder_layers": 3, "n_embd": 64, "d_model": 64, "n_head": 4,
    "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4, "n_inner": 128, "ffn_dim": 128, "decoder_ffn_dim": 128,
    "n_positions": 128, "encoder_layers": 3, "encoder_attention_heads": 4, "encoder_ffn_dim": 128,
    "num_decoder_layers": 3, "num_encoder_layers": 3, "num_decoder_attention_heads": 4,
    "num_encoder_attention_heads": 4,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "n_group": 1, "topk_group": 1, "attention_chunk_size": 4, "rotary_dim": 8,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
}
#: Sizes of the other towers of a composite config (vision, audio): one layer, so their block lists never match the
#: text model's.
TOWER_SIZES = {**SIZES, "num_hidden_layers": 1, "depth": 1, "num_layers": 1, "n_layers": 1, "hidden_size": 32,
               "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "num_heads": 2,
               "out_hidden_size": 64, "projection_dim": 32}
#: Sizes that follow from what else the config has: latent attention's head_dim is its rotary part, and its keys and
#: values are expanded to every query head.
WHEN = {"qk_rope_head_dim": {"head_dim": 8}, "kv_lora_rank": {"num_key_value_heads": 4}}
#: Sizes that may start unset (None) and still be set.
UNSET_SIZES = ("head_dim", "pad_token_id", "num_key_value_heads")
#: Per-layer lists (one entry per block): each kind in the default config's list, in order of first appearance, cycled
#: over the tiny depth, so a hybrid's every kind of block is built.
PER_LAYER = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types")
#: Flags that make an encoder (BERT-like, XLM) run as a decoder, set where the config has them.
DECODER_FLAGS = {"is_decoder": True, "causal": True}

#: Per-type config keyword arguments, over SIZES (and over a registered family's `Family.tiny`), where the generic
#: sizes fail or hide a kind of block (a hybrid's attention blocks). A sub-config's are a nested dict; a text type's
#: apply inside the composites that hold it (`mllama_text_model` in `mllama`).
OVERRIDES: dict[str, dict] = {
    "bamba": {"attn_layer_indices": [1]},
    # bytes -> patches -> a global transformer -> bytes; its cache cannot be built from BltConfig (no
    # num_hidden_layers), so it runs without one
    "blt": {"use_cache": False, "encoder_hash_byte_group_vocab": 128, **{
        part: {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
               "num_hidden_layers": layers, "vocab_size": 128, **({"hidden_size_global": 64} if local else {})}
        for part, layers, local in (("patcher_config", 1, False), ("encoder_config", 1, True),
                                    ("decoder_config", 3, True), ("global_config", 2, False))}},
    "cohere_compass_text": {"rope_parameters": {kind: {"rope_type": "default", "rope_theta": 10000.0}
                                                for kind in ("full_attention", "sliding_attention")}},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "dots3_note": {"vision_config": {"per_layer_config": {}, "mlp_layer_types": ["dense"], "adapter_in_dim": 32,
                                     "adapter_out_dim": 64},
                   "audio_config": {"adapter_input_size": 32, "adapter_out_dim": 64}},
    # per-layer configs: the sliding layers' sizes come as swa_* arguments
    "dots3_note_text": {"num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                        "head_dim": 24, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4,
                        "swa_q_lora_rank": 32, "swa_kv_lora_rank": 16, "swa_head_dim": 24, "swa_qk_nope_head_dim": 16,
                        "swa_v_head_dim": 16, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4},
    "falcon_h1": {"mamba_d_ssm": 128},
    "gemma3n_text": {"num_hidden_layers": 4, "intermediate_size": [128] * 4, "num_kv_shared_layers": 2,
                     "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 128, "laurel_rank": 8,
                     "activation_sparsity_pattern": [0.0] * 4},
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention", "linear_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "laguna": {"num_attention_heads_per_layer": [4, 4, 4]},
    "lfm2": {"full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"], "num_dense_layers": 1},
    # layers without rotary embedding (Llama 4's are its full-attention layers; the others are chunked)
    "llama4_text": {"no_rope_layers": [1, 0, 1]},
    "mamba2": {"num_heads": 8, "n_groups": 1},
    "mllama_text_model": {"cross_attention_layers": [1]},
    "musicgen": {"decoder": {"num_codebooks": 1}},
    "musicgen_melody": {"decoder": {"num_codebooks": 1}},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 4,
                       "indexer_compress_ratio": 2, "hc_lowrank": 16, "ple_embed_dim": 64},
    "reformer": {"axial_pos_embds": False, "attention_head_size": 16, "feed_forward_size": 128,
                 "attn_layers": ["local", "lsh", "local"]},
    "smollm3": {"no_rope_layers": [1, 0, 1]},
    "xlstm": {"embedding_dim": 64, "num_blocks": 3, "qk_dim_factor": 1.0},  # 0.5 fails the tiny recurrent step
    "xmod": {"default_language": "en_XX"},
    # two hybrid blocks share one transformer (tied weights), so there must be two
    "zamba": {"num_hidden_layers": 4, "attention_hidden_size": 128, "attention_head_dim": 32, "mamba_dt_rank": 4},
    "zaya": {"num_experts_per_tok": 1},
}


# --- building ------------------------------------------------------------------------------------------------


def _sized(config, sizes: dict) -> dict:
    """The entries of `sizes` that `config` (a default instance) has, of the same type (or may leave unset)."""
    chosen = {}
    for key, value in sizes.items():
        if isinstance(getattr(type(config), key, None), property):
            continue  # derived from other sizes (Falcon's head_dim)
        try:
            current = getattr(config, key)
        except Exception:  # noqa: BLE001  (absent, or a per-layer attribute that refuses a global read)
            continue
        if type(current) is type(value) is not bool or current is None and key in UNSET_SIZES:
            chosen[key] = value
    for attribute, sizes in WHEN.items():
        if _has(config, attribute):
            chosen = _merge(chosen, sizes)
    return chosen


def _per_layer(config, kwargs: dict) -> dict:
    """`kwargs` with each per-layer list of `config` it does not set cycled over its depth (see PER_LAYER)."""
    depth = kwargs.get("num_hidden_layers", getattr(config, "num_hidden_layers", None))
    cycled = {}
    for key in PER_LAYER:
        kinds = vars(config).get(key)  # a field, not an alias or a property
        if isinstance(kinds, (list, tuple)) and key not in kwargs and len(set(kinds)) > 1 and depth:
            kinds = list(dict.fromkeys(kinds))
            cycled[key] = [kinds[i % len(kinds)] for i in range(depth)]
    return {**kwargs, **cycled}


def _has(config, attribute: str) -> bool:
    try:
        return hasattr(config, attribute)
    except Exception:  # noqa: BLE001  (per-layer attributes refuse a global read)
        return True


def _merge(base: dict, extra: dict) -> dict:
    """`extra` over `base`, nested dicts merged, None removing a key."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return {k: v for k, v in merged.items() if v is not None}


def default_config(model_type: str):
    """The config class's default instance (with the type's overrides where the bare default fails validation)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001
        return CONFIG_MAPPING[model_type](**OVERRIDES.get(model_type, {}))


def tiny_kwargs(model_type: str) -> dict:
    """The config keyword arguments of the survey's tiny model of `model_type`."""
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = default_config(model_type)
    text = default.get_text_config(decoder=True)
    family = _registered().get(model_type)
    recipe = family.tiny if family is not None else None
    if recipe is not None and recipe[0] == config_class.__name__:  # the family's own tested recipe
        return _merge({**TINY_DEFAULTS, **recipe[2]}, OVERRIDES.get(model_type, {}))
    kwargs = {**_sized(default, SIZES), **{k: v for k, v in DECODER_FLAGS.items() if _has(default, k)}}
    for name in getattr(config_class, "sub_configs", {}):
        sub = getattr(default, name, None)
        if isinstance(sub, PreTrainedConfig):
            if sub is text and recipe is not None and recipe[0] == type(text).__name__:
                kwargs[name] = _merge({"model_type": sub.model_type, **TINY_DEFAULTS}, recipe[2])
            else:
                kwargs[name] = {"model_type": sub.model_type, **_sized(sub, SIZES if sub is text else TOWER_SIZES)}
            kwargs[name] = _merge(kwargs[name], OVERRIDES.get(sub.model_type, {}))  # a text type's, in a composite
            if sub is text:
                kwargs[name] = _per_layer(sub, kwargs[name])
    return _per_layer(default, _merge(kwargs, OVERRIDES.get(model_type, {})))


def build(model_type: str, **overrides):
    """The tiny model of `model_type` (config `overrides` on top): float32, eager attention, seeded, norms perturbed
    as `attnlens.models` does."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = CONFIG_MAPPING[model_type](**_merge(tiny_kwargs(model_type), overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    # as transformers builds it: a composite config's text (or decoder) part goes to a text-only causal-LM class
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    text = config.get_text_config(decoder=True)
    if not isinstance(config, model_class.config_class) and isinstance(text, model_class.config_class):
        config = text
    model = model_class(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if "norm" in type(module).__name__.lower():
                for parameter in module.parameters(recurse=False):
                    parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def _registered() -> dict:
    from .registry import registered

    return registered()


def _first_line(error: BaseException) -> str:
    """The error's type and first line (and the next, where the first only introduces it)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines or [""])[0]
    return f"{type(error).__name__}: {text[:300]}".rstrip(": ")


# --- where the blocks are, and which of them run a softmax over positions ------------------------------------------


def find_layers(model) -> str | None:
    """The path of the block list: a ModuleList as long as the text config's `num_hidden_layers` (the decoder's if
    several are), else the first list of at least two modules of one class."""
    try:
        depth = model.config.get_text_config(decoder=True).num_hidden_layers
    except Exception:  # noqa: BLE001
        depth = None
    try:
        decoder = {id(m) for m in model.get_decoder().modules()}
    except Exception:  # noqa: BLE001
        decoder = set()
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) >= 2]
    exact = [name for name, m in lists if len(m) == depth]
    uniform = [name for name, m in lists if len({type(block) for block in m}) == 1]
    ranked = [name for name, m in lists if len(m) == depth and id(m) in decoder] + exact + uniform
    return ranked[0] if ranked else None


class _Softmaxes(torch.overrides.TorchFunctionMode):
    """Records each softmax over positions (input [..., queries, keys] over the last axis, queries = the block's
    sequence length <= keys) with the block and the innermost module running it, through a stack the modules' hooks
    keep."""

    #: A softmax, or its normaliser where the forward writes it as exp(x - logsumexp(x)) (Reformer).
    FUNCTIONS = (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax, torch.special.softmax,
                 torch.logsumexp, torch.Tensor.logsumexp)

    def __init__(self, model, layers_path: str, length: int):
        super().__init__()
        self.stack: list[str] = []
        self.seen: list[tuple[int, str]] = []
        self.blocks = {f"{layers_path}.{i}": i for i in range(len(model.get_submodule(layers_path)))}
        #: The sequence lengths a block's queries may have: the prompt's, and its input's (patches, not tokens, in
        #: Blt's global transformer; XLNet's blocks take [seq, batch, hidden]).
        self.length = length
        self.lengths = {name: {length} for name in self.blocks}
        self.modules = dict(model.named_modules())
        self.handles = []
        for name, module in self.modules.items():
            self.handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, name=name: self._enter(name, args, kwargs), with_kwargs=True))
            self.handles.append(module.register_forward_hook(lambda m, a, o: self._leave(), always_call=True))

    def _enter(self, name: str, args, kwargs) -> None:  # hooks return None, or they would replace the input or output
        self.stack.append(name)
        if name in self.blocks:
            hidden = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.ndim == 3), None)
            self.lengths[name] = {self.length} | (set(hidden.shape[:2]) - {1} if hidden is not None else set())

    def _leave(self) -> None:
        self.stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FUNCTIONS and args and isinstance(args[0], torch.Tensor):
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
            block = next((name for name in self.stack if name in self.blocks), None)
            if block and x.ndim >= 3 and dim in (-1, x.ndim - 1) and x.shape[-2] in self.lengths[block] \
                    and x.shape[-1] >= x.shape[-2]:
                inner = next(name for name in reversed(self.stack)  # the module computing, not an nn.Softmax
                             if not isinstance(self.modules[name], torch.nn.Softmax))
                self.seen.append((self.blocks[block], inner[len(block) + 1:] if inner.startswith(block) else
                                  "/" + inner))
        return func(*args, **kwargs)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def run(model, layers_path: str | None) -> tuple[torch.Tensor, dict[int, list[str]]]:
    """One forward on `TOKENS`: the logits, and for each block the modules that ran a softmax over positions (a
    path relative to the block; '/path' from the model for a module the block borrows)."""
    if layers_path is None:
        with torch.no_grad():
            return model(input_ids=TOKENS).logits, {}
    watch = _Softmaxes(model, layers_path, TOKENS.shape[1])
    try:
        with torch.no_grad(), watch:
            logits = model(input_ids=TOKENS).logits
    finally:
        watch.remove()
    seen: dict[int, list[str]] = {}
    for layer, path in watch.seen:
        if path not in seen.setdefault(layer, []):
            seen[layer].append(path)
    return logits, seen


def is_causal(model, logits: torch.Tensor) -> bool:
    """Whether changing the last token leaves every earlier position's logits alone."""
    changed = TOKENS.clone()
    changed[0, -1] = 20
    with torch.no_grad():
        other = model(input_ids=changed).logits
    return bool(torch.allclose(logits[:, :-1], other[:, :-1], atol=1e-5))


# --- how an attention module computes: read off its source --------------------------------------------------------


def _compiled(function):
    from .parts.source import compiled

    return compiled(function)


def interface_call(cls) -> dict | None:
    """`attnlens.inferred.interface_call`, with the keywords' names, the eager function's qualified name and what it
    does (`eager_operations`), as the records keep them."""
    from . import inferred

    call = inferred.interface_call(cls)
    if call is None:
        return None
    eager = call["eager"]
    return {"operation": call["operation"], "arguments": call["arguments"], "keywords": list(call["keywords"]),
            "eager": _qualname(eager) if eager else None, **(eager_operations(eager) if eager else {})}


def _qualname(function) -> str:
    return f"{function.__module__}.{function.__qualname__}"


def _assignment(lines: dict[str, str], anchor: str) -> str | None:
    """The first assignment operation (`x_N` on a line `x = ...`) whose line contains `anchor`."""
    return next((name for name, line in lines.items() if anchor in line
                 and line.startswith(name.rsplit("_", 1)[0] + " =")), None)


def eager_operations(function) -> dict:
    """Where the eager function holds the masked scores and the pattern after dropout (by the common layout's
    anchors), and what else it does: sinks, soft-capping."""
    from .parts.source import operation_lines

    lines = operation_lines(function)
    source = _compiled(function)[1].source
    extras = [name for name, words in EAGER_EXTRAS.items() if any(word in source for word in words)]
    return {"scores": _assignment(lines, Family.scores_operation[1]),
            "probabilities": _assignment(lines, Family.probabilities_operation[1]), "eager_extras": extras}


#: What the eager function may do besides the common arithmetic, and the words in its source that show it.
EAGER_EXTRAS = {"sinks": ("sinks", "s_aux"), "softcap": ("tanh(", "softcap")}


# --- how a model departs from the common layout -----------------------------------------------------------------


def _module(root, path: str):
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        return None


def _attention_module(model, block, path: str):
    return _module(model, path[1:]) if path.startswith("/") else _module(block, path)


def _children(module, word: str = "") -> list[str]:
    return [name for name, _ in module.named_children() if word in name.lower()]


#: The common layout's roles whose absence the inferred layout can take: the blocks and the embeddings are found from
#: the model's structure (as `UnknownLayout` finds them), and a missing final norm or MLP part costs only its value.
#: Role -> the value it costs (None: nothing). Every other difference blocks.
TOLERATED = {"layers": None, "embed_tokens": None, "final_norm": "final_norm_output", "activation": "mlp_activation",
             "down_projection": "mlp_neurons"}


def model_paths(model, layers_path: str) -> dict[str, str]:
    """The model-level paths an inferred layout would use: the block list found, the input embeddings, and the final
    norm where the common layout puts it, beside the blocks (`model.norm` for `model.layers`)."""
    names = {id(m): n for n, m in model.named_modules()}
    parent = layers_path.rpartition(".")[0]
    norm = f"{parent}.{Family.final_norm.rpartition('.')[2]}".lstrip(".")
    return {"layers": layers_path, "embed_tokens": names.get(id(model.get_input_embeddings())),
            "final_norm": norm if _module(model, norm) is not None else None}


def differences(model, layers_path: str, attention: dict[int, str]) -> list[dict]:
    """Where the model departs from what the common layout (`attnlens.Family`) reads, in the order it reads it: one
    {"role", "expected", "found", "blocking"} each (with "layer" for a block's), checked on the first block of each
    kind among the `attention` blocks (block index -> its attention module's path); [] where every name matches."""
    common = Family()
    found: list[dict] = []

    def differ(role, expected, actual, layer=None):
        found.append({"role": role, "expected": expected, "found": actual, "blocking": role not in TOLERATED,
                      **({"layer": layer} if layer is not None else {})})

    for role, actual in model_paths(model, layers_path).items():
        if actual != getattr(common, role):
            differ(role, getattr(common, role), actual)
    blocks, kinds = model.get_submodule(layers_path), set()
    for layer, path in attention.items():
        block = blocks[layer]
        if (type(block), path) in kinds:
            continue
        kinds.add((type(block), path))
        module = _attention_module(model, block, path)
        if path != common.attention:
            differ("attention", common.attention, path, layer)
        for role in ("attention_norm", "mlp_norm", "mlp"):
            if _module(block, getattr(common, role)) is None:
                differ(role, getattr(common, role), ", ".join(_children(block)), layer)
        mlp = _module(block, common.mlp)
        for role in ("activation", "down_projection"):
            if mlp is not None and _module(mlp, getattr(common, role)) is None:
                differ(role, getattr(common, role), ", ".join(_children(mlp)), layer)
        if _module(module, common.output_projection) is None:
            differ("output_projection", common.output_projection, ", ".join(_children(module)), layer)
        call = interface_call(type(module))
        if call is None:
            differ("interface_call", INTERFACE_CALL, f"none: {type(module).__name__} computes attention itself", layer)
            continue
        if call["operation"] != INTERFACE_CALL:
            differ("interface_call", INTERFACE_CALL, call["operation"], layer)
        if call["arguments"][:1] != ["self"] or len(call["arguments"]) < 4:  # read by position; the rest may be named
            differ("interface_arguments", "self, query, key, value, ...",
                   ", ".join(call["arguments"] + [f"{k}=" for k in call["keywords"]]), layer)
        if call["eager"] is None:
            differ("eager_function", "eager_attention_forward", None, layer)
            continue
        for role, (operation, anchor) in (("scores", Family.scores_operation),
                                          ("probabilities", Family.probabilities_operation)):
            if call[role] != operation:
                differ(f"{role}_operation", f"{operation} on a line with {anchor!r}", call[role], layer)
    return found


#: Config attributes that change attention, reported where set (lists summarised).
CONFIG_FEATURES = ("layer_types", "sliding_window", "attention_chunk_size", "no_rope_layers", "kv_lora_rank",
                   "attn_logit_softcapping",
                   "final_logit_softcapping", "partial_rotary_factor", "use_qk_norm", "attention_multiplier",
                   "logit_scale", "residual_multiplier", "embedding_multiplier", "clip_qkv", "alibi")


def features(model, layers_path: str, attention: dict[int, str]) -> dict[str, str]:
    """What the attention layers do beyond the common arithmetic, names found in the model and its config: norms in
    the attention module (QK norms mostly), fused projections, output gates, sinks, soft-caps, other norms in the
    block, expert MLPs, windows, chunks, layers without rotary embedding, latent ranks."""
    found: dict[str, str] = {}
    blocks = model.get_submodule(layers_path)
    for layer, path in attention.items():
        block = blocks[layer]
        module = _attention_module(model, block, path)
        kind = type(module).__name__
        norms = _children(module, "norm")
        if norms:  # QK norms mostly; also latent and sub-layer norms
            found.setdefault("attention_norms", f"{kind}: {', '.join(norms)}")
        if not all(_module(module, p) is not None for p in ("q_proj", "k_proj", "v_proj")):
            found.setdefault("projections", f"{kind}: {', '.join(_children(module))}")
        call = interface_call(type(module))
        for extra in (call or {}).get("eager_extras", []):
            found.setdefault(extra, f"in {call['eager']}")
        source = _compiled(type(module).forward)[1].source
        if "sigmoid" in source:
            found.setdefault("output_gate", f"sigmoid in {kind}.forward")
        extra_norms = [n for n in _children(block, "norm") if n not in (Family.attention_norm, Family.mlp_norm)]
        if extra_norms:
            found.setdefault("block_norms", f"{type(block).__name__}: {', '.join(extra_norms)}")
        mlp = _module(block, Family.mlp)
        if mlp is not None and _module(mlp, Family.down_projection) is None:
            found.setdefault("mlp", f"{type(mlp).__name__}: {', '.join(_children(mlp))}")
    config = model.config.get_text_config(decoder=True)
    for name in CONFIG_FEATURES:
        value = getattr(config, name, None)
        if value not in (None, False, 1.0, [], {}):
            found[f"config.{name}"] = _summary(value)
    return found


def _summary(value) -> str:
    if isinstance(value, (list, tuple)) and len(value) > 4:
        kinds = sorted({str(v) for v in value})
        return f"{len(value)} entries of {', '.join(kinds)}" if len(kinds) <= 4 else f"{len(value)} entries"
    return str(value)


# --- running the identities --------------------------------------------------------------------------------------


class CommonLayoutProbe(Family):
    """The common layout, as an inferred family would apply it to a model attnlens does not know: the blocks, the
    embeddings and the final norm found from the structure (`model_paths`); on the blocks that run softmax attention
    at `self_attn`, every value whose module exists there; on the other blocks, their input and output. `dropped`
    names the values left out for a missing module."""

    MODEL_VALUES = ("embeddings", "final_norm_output", "logits")
    SCOPES = {"model": "", "layer": "", "attention": Family.attention, "mlp": Family.mlp}

    def __init__(self, model, layers_path: str, attention_layers: list[int]):
        from .locations import Location

        self.name_ = f"common layout ({model.config.model_type})"
        paths = model_paths(model, layers_path)
        self.layers, self.embed_tokens = paths["layers"], paths["embed_tokens"]
        self.final_norm = paths["final_norm"] or Family.final_norm  # absent: dropped below
        common = self.locations()
        blocks = model.get_submodule(layers_path)
        self.dropped: set[str] = set()
        self.by_layer = {}
        for layer in range(len(blocks)):
            kept = {}
            for name, location in common.items():
                scope = next(v.scope for v in _values() if v.name == name)
                host = model if scope == "model" else _module(blocks[layer], self.SCOPES[scope])
                path = getattr(location, "module", "")
                if layer not in attention_layers and scope != "model" and name not in ("layer_input", "layer_output"):
                    continue
                if isinstance(path, str) and path and (host is None or _module(host, path) is None):
                    self.dropped.add(name)
                    continue
                assert isinstance(location, Location)
                kept[name] = location
            self.by_layer[layer] = kept
        self.model_locations = {k: v for k, v in self.by_layer[0].items() if k in self.MODEL_VALUES}

    @property
    def name(self):
        return self.name_

    def locations_for(self, config, layer, engine="transformers"):
        return self.model_locations if layer is None else self.by_layer[layer]


def _values():
    from .values import ALL_VALUES

    return ALL_VALUES


def check(model, family: Family, layers: list[int]) -> dict:
    """Load `model` under `family` (its load-time checks) and run `attnlens.checks` on `layers`: {"ok", "error",
    "failures": {layer: [identity, ...]}}."""
    from . import checks
    from .models import char_tokenizer
    from .standardized import StandardizedTransformer

    try:
        standardized = StandardizedTransformer(model, tokenizer=char_tokenizer(), family=family)
        saved = checks.read_everything(standardized, PROMPT)
        failures = {layer: bad for layer in layers if (bad := checks.failures(standardized, saved, layer))}
    except Exception as error:  # noqa: BLE001
        return {"ok": False, "error": _first_line(error), "failures": {}}
    return {"ok": not failures, "error": None, "failures": failures}


# --- one type ------------------------------------------------------------------------------------------------------

#: Forward parameters and sub-configs that carry something other than text, by the words in their names.
MODALITY_WORDS = ("pixel", "image", "vision", "video", "audio", "speech", "input_features", "input_values")


def classes(model_type: str) -> tuple[str, str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return CONFIG_MAPPING[model_type].__name__, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def static_facts(model_type: str) -> dict:
    """What the classes say before anything is built: composite configs (their towers), non-text inputs, whether
    the config is an encoder-decoder's, registered types served by the same causal-LM class."""
    import inspect

    import transformers

    config_class, model_class = classes(model_type)
    default = default_config(model_type)
    text = default.get_text_config(decoder=True)
    towers = [n for n in getattr(type(default), "sub_configs", {}) if getattr(default, n, None) is not text]
    forward = getattr(transformers, model_class).forward
    inputs = [p for p in inspect.signature(forward).parameters if any(w in p for w in MODALITY_WORDS)]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    same = sorted(t for t in _registered()  # registered types the mapping lacks (mllama_text_model) have no class
                  if t != model_type and MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(t) == model_class)
    return {"config_class": config_class, "causal_lm_class": model_class, "sub_configs": towers,
            "modality_inputs": inputs, "encoder_decoder": bool(default.is_encoder_decoder), "same_class_as": same}


def layout(kinds: list[str]) -> str:
    """The model's layout from its blocks' kinds ("interface", "own", "none")."""
    present = set(kinds)
    if present == {"none"}:
        return "attention-free"
    if "none" in present:
        return "hybrid"
    return present.pop() if len(present) == 1 else "mixed"


def survey_type(model_type: str) -> dict:
    """The survey's record of one model type (see docs/survey.md for the fields)."""
    record: dict = {"model_type": model_type}
    family = _registered().get(model_type)
    record["registered"] = family.__name__ if family else None
    start = time.perf_counter()
    try:
        record.update(static_facts(model_type))
        record["tiny_kwargs"] = tiny_kwargs(model_type)
        model = build(model_type)
        layers_path = find_layers(model)
        logits, softmaxes = run(model, layers_path)
        record["build"] = {"ok": True, "seconds": round(time.perf_counter() - start, 1), "error": None}
    except BaseException as error:  # noqa: BLE001  (the survey's worker turns a timeout into an exception)
        record["build"] = {"ok": False, "seconds": round(time.perf_counter() - start, 1), "error": _first_line(error)}
        return record
    try:
        _inspect(model_type, record, model, layers_path, logits, softmaxes, family)
    except Exception as error:  # noqa: BLE001  (recorded, so one type's surprise costs only its own record)
        record["error"] = _first_line(error)
    return record


def _inspect(model_type, record, model, layers_path, logits, softmaxes, family) -> None:
    """The record's fields after the build: causality, the blocks' kinds, what attnlens serves, the common layout."""
    record["causal"] = is_causal(model, logits)
    record["encoder_style"] = _encoder_style(model_type, record)
    record["layers_path"] = layers_path
    record.update(_layers(model, layers_path, softmaxes))
    attention = {layer: paths[0] for layer, paths in softmaxes.items()}
    if family is not None:
        family = _registered().get(model.config.model_type, family)  # the built text model's own type, as on load
        served = check(model, family(), list(range(len(record["layers"]))))
        record["serves"] = {"family": family.__name__, "check": served}
    else:
        record["serves"] = {"family": None, **_unknown(model), **_inferred(model, len(record["layers"]))}
    if attention and layers_path is not None:
        record["common_layout"] = _common(model, layers_path, attention)


def _encoder_style(model_type: str, record: dict) -> str | None:
    """How the type is an encoder's (None where it is a plain decoder): the decoder of an encoder-decoder, or an
    encoder that is causal only with its decoder flags (built once more without them to see)."""
    if record["encoder_decoder"]:
        return "decoder of an encoder-decoder"
    flags = {k: v for k, v in DECODER_FLAGS.items() if record["tiny_kwargs"].get(k) == v}
    if not flags:
        return None
    needed = ", ".join(f"{k}={v}" for k, v in flags.items())
    try:
        model = build(model_type, **{k: not v for k, v in flags.items()})
        with torch.no_grad():
            logits = model(input_ids=TOKENS).logits
    except Exception:  # noqa: BLE001
        return f"encoder, runs only with {needed}"
    return None if is_causal(model, logits) else f"encoder, causal only with {needed}"


def _layers(model, layers_path: str | None, softmaxes: dict[int, list[str]]) -> dict:
    """Each block's kind (interface, own arithmetic, or no softmax attention) and the attention module's path."""
    if layers_path is None:
        return {"layers": [], "layout": None, "kinds": []}
    blocks = model.get_submodule(layers_path)
    kinds, groups = [], {}
    for layer, block in enumerate(blocks):
        path = (softmaxes.get(layer) or [None])[0]
        module = _attention_module(model, block, path) if path is not None else None
        kind = "none" if module is None else "interface" if interface_call(type(module)) else "own"
        kinds.append(kind)
        key = (kind, type(block).__name__, path, type(module).__name__ if module is not None else None)
        groups.setdefault(key, []).append(layer)
    described = [{"layers": layers, "kind": kind, "block": block, "attention": path, "class": cls,
                  **({"children": _children(blocks[layers[0]])} if kind == "none" else {}),
                  **({"softmax_modules": softmaxes[layers[0]]} if len(softmaxes.get(layers[0], [])) > 1 else {})}
                 for (kind, block, path, cls), layers in groups.items()]
    return {"layers": kinds, "layout": layout(kinds), "kinds": described}


def _inferred(model, depth: int) -> dict:
    """What the inferred common layout (`attnlens.inferred`) makes of an unregistered type: the family and the
    identities on every block, with the values it leaves out on some attention layer; else the first check that
    refused it."""
    from .inferred import Inferred, NotCommonLayout

    try:
        family = Inferred(model)
    except NotCommonLayout as refusal:
        return {"inferred": None, "refused": {"check": refusal.check, "detail": refusal.detail[:300]}}
    common = set(Family().locations_for(model.config, 0))  # what a common-layout attention layer serves
    served = [set(family.locations_for(model.config, layer)) for layer in family.attention_layers]
    return {"inferred": family.name, "dropped": sorted(common - set.intersection(*served)),
            "check": check(model, family, list(range(depth)))}


def _unknown(model) -> dict:
    from .family import UnknownLayout

    try:
        return {"unknown_layout": UnknownLayout(model).layers, "error": None}
    except Exception as error:  # noqa: BLE001
        return {"unknown_layout": None, "error": _first_line(error)}


def _common(model, layers_path: str, attention: dict[int, str]) -> dict:
    """The common layout against the model: differences by name, features, and the identities on its attention
    blocks (where those hold their attention at `self_attn`, so that the probe can read it). `fits`: the identities
    hold and nothing blocking differs; `dropped`: the values it would then not serve."""
    found = differences(model, layers_path, attention)
    result = {"differences": found, "features": features(model, layers_path, attention), "check": None,
              "dropped": []}
    if all(d["role"] != "attention" for d in found):
        probe = CommonLayoutProbe(model, layers_path, sorted(attention))
        result["check"] = check(model, probe, sorted(attention))
        result["dropped"] = sorted(probe.dropped)
    passed = result["check"] is not None and result["check"]["ok"]
    result["fits"] = passed and not any(d["blocking"] for d in found)
    return result


def first_difference(common: dict) -> str | None:
    """The first thing that keeps the common layout off the model, in words: a blocking difference of names, else
    the probe's error or first failing identity; None where it fits."""
    if common["fits"]:
        return None
    blocking = [d for d in common["differences"] if d["blocking"]]
    if blocking:
        d = blocking[0]
        return f"{d['role']}: {d['found'] or 'the block itself'} (expected {d['expected']})"
    check = common["check"] or {}
    if check.get("error"):
        return f"probe: {check['error']}"
    layer, failed = next(iter(check.get("failures", {}).items()))
    return f"identity: {failed[0]} (layer {layer})"


# --- workers -------------------------------------------------------------------------------------------------------


def _worker(types: list[str]) -> None:
    """Survey `types` in this process, one JSON line before ("start") and after ("record") each."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)

    def timeout(signum, frame):
        raise TimeoutError(f"no result within {SECONDS_PER_TYPE} s")

    signal.signal(signal.SIGALRM, timeout)
    for model_type in types:
        print(json.dumps({"start": model_type}), flush=True)
        signal.alarm(SECONDS_PER_TYPE)
        try:
            record = survey_type(model_type)
        finally:
            signal.alarm(0)
        print(json.dumps({"record": record}, default=str), flush=True)


def _chain(python: str, types: list[str], records: dict) -> None:
    """Run workers of `python` over `types` until each has a record; a worker that dies or hangs costs the type it
    was surveying (recorded as a failed build), and a fresh worker takes the rest."""
    import threading

    pending = list(types)
    while pending:
        process = subprocess.Popen([python, "-m", "attnlens.survey", "--worker", *pending], cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=None if VERBOSE else subprocess.DEVNULL, text=True)
        current, timer = None, None
        for line in process.stdout:
            if timer:
                timer.cancel()
            timer = threading.Timer(3 * SECONDS_PER_TYPE, process.kill)
            timer.start()
            message = json.loads(line)
            if "start" in message:
                current = message["start"]
            else:
                records[message["record"]["model_type"]] = message["record"]
                pending.remove(message["record"]["model_type"])
        if timer:
            timer.cancel()
        process.wait()
        if current in pending:
            pending.remove(current)
            records[current] = {"model_type": current, "build": {
                "ok": False, "seconds": None, "error": f"the worker died surveying it (exit {process.returncode})"}}


def survey(types: list[str], python: str = sys.executable, jobs: int = 2) -> dict[str, dict]:
    """Records for `types` in their order, from `jobs` chains of worker processes of `python`."""
    import threading

    records: dict[str, dict] = {}
    threads = [threading.Thread(target=_chain, args=(python, types[i::jobs], records)) for i in range(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {t: records[t] for t in types}


def installed() -> dict:
    """The installed versions and every causal-LM model type of the installed transformers."""
    import nnsight
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {"versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                         "nnsight": nnsight.__version__}, "types": list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)}


# --- the page ----------------------------------------------------------------------------------------------------

#: Why some types need more than the survey can give them, where the error alone does not say (shown in the notes).
NOTES = {
    "gemma3n": "its vision tower is a timm model (TimmWrapperModel), and timm is not installed",
    "gemma4_assistant": "a draft model for speculative decoding: its forward takes the target model's inputs_embeds "
                        "and shared_kv_states, not token ids",
    "gemma4_unified_assistant": "a draft model for speculative decoding: its forward takes the target model's "
                                "inputs_embeds and shared_kv_states, not token ids",
    "cpmant": "the prompt's tokens (its context) see each other both ways; only generated tokens are causal",
    "blt": "bytes are grouped into patches: the global transformer's blocks attend over patches, the local encoder "
           "and decoder cross-attend between bytes and patches",
    "xlnet": "a permutation language model: bidirectional unless given a perm_mask",
    "mllama": "its cross-attention blocks (block 1 here) run only with image inputs; on text alone they are skipped",
    "dory": "its recurrent blocks run more than once per forward",
    "nanochat": "model.norm runs twice: on the embeddings before the first block, and after the last",
    "xlm": "no block modules: parallel lists (transformer.attentions, layer_norm1, ffns, layer_norm2), so the "
           "attention modules are the blocks found",
    "zamba": "one transformer block is shared by the hybrid layers",
    "zamba2": "transformer blocks are shared by the hybrid layers",
}
#: How the attention-bearing types attnlens does not register are grouped on the page: latent attention first, then
#: by the role of the first blocking difference (see `differences`), or the probe's outcome.
GROUPS = {
    "attention": "the attention module is not at `self_attn`",
    "attention_norm": "the block's norms or MLP are named otherwise (post-norms, parallel or expert blocks)",
    "mlp_norm": "the block's norms or MLP are named otherwise (post-norms, parallel or expert blocks)",
    "mlp": "the block's norms or MLP are named otherwise (post-norms, parallel or expert blocks)",
    "output_projection": "no `o_proj` in the attention module",
    "interface_call": "the attention computes itself (no attention interface)",
    "interface_arguments": "the attention interface is called with other arguments",
    "eager_function": "no eager attention function",
    "scores_operation": "the eager function differs (soft-caps, sinks, other steps)",
    "probabilities_operation": "the eager function differs (soft-caps, sinks, other steps)",
    "latent": "latent attention (`kv_lora_rank`), as in DeepSeek-V2 and V3",
    "probe": "every name matches, but the probe fails",
    "identity": "every name matches, but an identity fails",
}


def _attention_bearing(record: dict) -> bool:
    return record["build"]["ok"] and record.get("layout") not in (None, "attention-free")


def categories(data: dict) -> dict[str, list[str]]:
    """The page's counts: label -> the types counted."""
    records = data["records"]
    version = data["versions"]["transformers"]

    def having(test) -> list[str]:
        return [t for t, r in records.items() if test(r)]

    built = having(lambda r: r["build"]["ok"])
    other = data.get("other") or {}
    return {
        f"causal-LM model types in transformers {version}": list(records),
        "build tiny on CPU and run a forward on 8 token ids": built,
        "refused (do not build)": having(lambda r: not r["build"]["ok"]),
        "attention-bearing: a softmax over positions in at least one block": having(_attention_bearing),
        "… every block through the shared attention interface": having(lambda r: r.get("layout") == "interface"),
        "… every block by its own arithmetic": having(lambda r: r.get("layout") == "own"),
        "… some blocks each way": having(lambda r: r.get("layout") == "mixed"),
        "… hybrid: some blocks without softmax attention": having(lambda r: r.get("layout") == "hybrid"),
        "attention-free": having(lambda r: r.get("layout") == "attention-free"),
        "encoder-style: an encoder run as a decoder, or an encoder-decoder's decoder": having(
            lambda r: r.get("encoder_style") or r.get("encoder_decoder")),
        "multimodal: a vision or audio tower, or non-text inputs": having(_multimodal),
        "not causal as built": having(lambda r: r.get("causal") is False),
        "registered in attnlens": having(lambda r: r["registered"]),
        "… whose family's checks pass on the survey's model": having(
            lambda r: r["registered"] and (r.get("serves") or {}).get("check", {}).get("ok")),
        "served by the inferred common layout (unregistered, every check of `attnlens.inferred` passes)": having(
            lambda r: (r.get("serves") or {}).get("inferred")),
        "… whose identities pass on the survey's model": having(
            lambda r: (r.get("serves") or {}).get("inferred") and r["serves"]["check"]["ok"]),
        "attention-bearing, not registered": having(lambda r: _attention_bearing(r) and not r["registered"]),
        "common-layout candidates: not registered, the common layout fits": having(_candidate),
        "… without dropping a value": having(lambda r: _candidate(r) and not r["common_layout"]["dropped"]),
        **({f"in transformers {other['versions']['transformers']} too": [t for t in records if t in other["records"]],
            f"served by the inferred common layout in transformers {other['versions']['transformers']}": [
                t for t, r in other["records"].items() if r.get("inferred")]} if other else {}),
    }


def _multimodal(record: dict) -> list[str]:
    """The record's vision and audio sub-configs and non-text forward inputs."""
    towers = [n for n in record.get("sub_configs", []) if any(w in n for w in MODALITY_WORDS)]
    return towers + record.get("modality_inputs", [])


def _candidate(record: dict) -> bool:
    return _attention_bearing(record) and not record["registered"] and record["common_layout"]["fits"]


def group(record: dict) -> str:
    """Where an attention-bearing type attnlens does not register goes on the page."""
    common = record["common_layout"]
    if common["fits"]:
        return "fits" + (f", without {', '.join(common['dropped'])}" if common["dropped"] else "")
    if record.get("encoder_style"):
        return "encoder-style"
    if "config.kv_lora_rank" in common["features"]:
        return GROUPS["latent"]
    difference = first_difference(common)
    return GROUPS[difference.split(":")[0]]


def _blocks(record: dict) -> str:
    kinds = record.get("layers") or []
    softmax = [i for i, kind in enumerate(kinds) if kind != "none"]
    return f"{len(softmax)}/{len(kinds)}" + (f" ({', '.join(map(str, softmax))})" if 0 < len(softmax) < len(kinds)
                                             else "")


def _serves(record: dict) -> str:
    serves = record.get("serves")
    if serves is None:
        return f"{record['registered']} (not built)" if record["registered"] else "—"
    if serves["family"]:
        check = serves["check"]
        return f"{serves['family']}" + ("" if check["ok"] else f" (checks fail: {_check_text(check)})")
    if serves.get("inferred"):
        check = serves["check"]
        return f"{serves['inferred']}" + ("" if check["ok"] else f" (checks fail: {_check_text(check)})")
    refused = f"; not inferred: {serves['refused']['check']}" if serves.get("refused") else ""
    if serves["unknown_layout"]:
        return f"unknown layout (blocks `{serves['unknown_layout']}`){refused}"
    return f"nothing: {serves['error']}"


def _check_text(check: dict) -> str:
    if check["error"]:
        return check["error"]
    layer, failed = next(iter(check["failures"].items()))
    return f"{failed[0]}, layer {layer}"


def _common_text(record: dict) -> str:
    common = record.get("common_layout")
    if common is None:
        return "—"
    if common["fits"]:
        return "fits" + (f" without {', '.join(common['dropped'])}" if common["dropped"] else "")
    return "differs: " + first_difference(common)


def _notes(record: dict, other: dict | None) -> str:
    notes = []
    if not record["build"]["ok"]:
        notes.append(record["build"]["error"])
    if record["model_type"] in NOTES:
        notes.append(NOTES[record["model_type"]])
    if record.get("encoder_style"):
        notes.append(record["encoder_style"])
    elif record.get("encoder_decoder"):
        notes.append("decoder of an encoder-decoder")
    if record.get("causal") is False:
        notes.append("not causal as built")
    if _multimodal(record):
        notes.append("multimodal: " + ", ".join(_multimodal(record)))
    if record.get("same_class_as"):
        notes.append(f"same class as registered {', '.join(record['same_class_as'])}")
    return "; ".join(notes).replace("|", "\\|")


def _other_text(model_type: str, record: dict, other: dict | None) -> str:
    if not other:
        return "?"
    there = other["records"].get(model_type)
    if there is None:
        return "absent"
    if not there["build"]:
        return "fails"
    built = "builds" if there["layout"] == record.get("layout") else f"builds, {there['layout']}"
    return built + (", inferred" if there.get("inferred") else "")


def _checks() -> list[str]:
    from .inferred import CHECKS

    return list(CHECKS)


def render(data: dict) -> str:
    """docs/survey.md from the survey's data."""
    records, other = data["records"], data.get("other")
    versions = data["versions"]
    lines = [
        "# Causal-LM survey",
        "",
        f"Generated by `python -m attnlens.survey` with transformers {versions['transformers']}, torch "
        f"{versions['torch']} and nnsight {versions['nnsight']}"
        + (f"; the {other['versions']['transformers']} column with transformers {other['versions']['transformers']}"
           if other else "") + ".",
        "The data, one record per type, is `docs/survey.json`; how each column is found is at the end of the page.",
        "",
        "| | types |",
        "|---|---|",
        *[f"| {label} | {len(types)} |" for label, types in categories(data).items()],
        "",
        "## Attention-bearing types attnlens does not register, by what differs from the common layout",
        "",
    ]
    grouped: dict[str, list[str]] = {}
    for model_type, record in records.items():
        if _attention_bearing(record) and not record["registered"]:
            grouped.setdefault(group(record), []).append(model_type)
    for label in sorted(grouped, key=lambda g: (not g.startswith("fits"), g)):
        lines += [f"- {label} ({len(grouped[label])}): " + ", ".join(
            f"`{t}`" + (" (hybrid)" if records[t]["layout"] == "hybrid" else "") for t in grouped[label])]
    lines += ["", "## Attention-bearing types attnlens does not register, by what the inferred common layout makes of "
                  "them", "", "Served where every check of `attnlens.inferred.CHECKS` passes, else refused at the "
                  "first check that fails (docs/inferred.md):", ""]
    inferred: dict[str, list[str]] = {}
    for model_type, record in records.items():
        serves = record.get("serves") or {}
        if _attention_bearing(record) and not record["registered"]:
            label = "inferred" if serves.get("inferred") else f"refused at `{serves['refused']['check']}`" \
                if serves.get("refused") else "not tried"
            inferred.setdefault(label, []).append(model_type)
    order = ["inferred", *(f"refused at `{c}`" for c in _checks()), "not tried"]
    for label in sorted(inferred, key=order.index):
        lines.append(f"- {label} ({len(inferred[label])}): " + ", ".join(f"`{t}`" for t in inferred[label]))
    version = other["versions"]["transformers"] if other else "other"
    lines += ["", "## Every type", "",
              f"| type | builds | layout | softmax blocks | attnlens serves | {version} | common layout | notes |",
              "|---|---|---|---|---|---|---|---|"]
    for model_type, record in records.items():
        built = record["build"]["ok"]
        lines.append(f"| `{model_type}` | {'yes' if built else 'no'} | {record.get('layout') or '—'} | "
                     f"{_blocks(record) if built else '—'} | {_serves(record)} | "
                     f"{_other_text(model_type, record, other)} | {_common_text(record)} | {_notes(record, other)} |")
    return "\n".join(lines + ["", FIELDS]) + "\n"


FIELDS = """## How each column is found

- **type**: every key of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, built as `AutoModelForCausalLM` builds it (a composite
  config's text part goes to a text-only causal-LM class).
- **builds**: a tiny random model (float32, eager attention, seeded) runs one forward on 8 token ids. Its config is
  the config class's default with small sizes (`SIZES` in `attnlens/survey.py`, set where the class has the
  attribute; `TOWER_SIZES` for vision and audio towers), per-layer kind lists cycled so that each kind of block
  is built, the registered family's `Family.tiny` where there is one, and the per-type `OVERRIDES` where the generic
  sizes fail. Each record keeps the keyword arguments used (`tiny_kwargs`); where it does not build, the notes give
  the error's first line.
- **layout**: which blocks run a softmax over positions, seen at run time (a torch function mode records every
  `softmax`, and `logsumexp` over the last axis, whose input is [..., queries, keys] with the block's sequence
  length as queries, and the innermost module running it). A block with one is `interface` if that module's forward
  calls the attention interface (an assignment from `ALL_ATTENTION_FUNCTIONS`, then a call of it), else `own`
  arithmetic; a model is `interface`, `own` or `mixed` when every block has one, `hybrid` when some have none (Mamba,
  linear attention, convolutions, recurrent blocks), `attention-free` when none has.
- **softmax blocks**: how many blocks have one, and which where not all.
- **attnlens serves**: the registered family, with the outcome of `attnlens.checks` on every block of the survey's
  model; else the inferred common layout (`Inferred(type)`, `attnlens.inferred`: the names found from the model's
  structure and the source of its forwards, every check of `attnlens.inferred.CHECKS` passed before it serves), with
  the outcome of `attnlens.checks` on every block; else what `UnknownLayout` finds (block inputs and outputs,
  embeddings, logits) and the first check of the inferred layout that failed.
- **the other transformers**: whether the type exists there, builds, with which layout where it differs, and
  whether the inferred common layout serves it there.
- **common layout**: the common layout (`attnlens.Family`) against the model. First by name, on the first block of
  each kind (`differences`: the attention module at `self_attn` with `o_proj`; `input_layernorm`,
  `post_attention_layernorm` and `mlp` with `act_fn` and `down_proj` in the block; the attention interface called
  as `attention_interface_1` with `(self, query, key, value, ...)` by position; the eager function's masked
  scores as `attn_weights_1` on a line with `+ attention_mask` and its pattern as `attn_weights_3` on a line with
  `dropout(`). The block list, the embeddings and a final norm beside the blocks are found from the structure, so
  their paths differ without blocking; a missing final norm or MLP part costs only its value. Then, where the
  attention sits at `self_attn`, by running it: `CommonLayoutProbe` (the common layout on the softmax blocks,
  values whose module is missing dropped, only block inputs and outputs elsewhere) loads the model, which checks
  every operation's name and anchor, and `attnlens.checks` runs the identities on each softmax block. It *fits*
  when nothing blocking differs and the identities hold; otherwise the column gives the first blocking difference,
  the probe's error, or the first failing identity. Each record also lists `features`: what the attention does
  beyond the common arithmetic (norms in the attention module, QK norms mostly; fused projections, output gates,
  sinks, soft-caps, other norms in the block, expert MLPs, and the config's windows, chunks, layers without rotary
  embedding, latent ranks).
- **notes**: why a type does not build or needs more than token ids, whether it is an encoder (built once more
  without `is_decoder`/`causal` to see whether it is causal without them) or an encoder-decoder's decoder, whether
  it is causal as built (changing the last token leaves the earlier logits alone), whether it is multimodal (vision
  or audio sub-configs, forward parameters for pixels or audio), and registered types served by the same
  causal-LM class."""


def dump(data: dict) -> str:
    """The data as JSON, each type's record on one line (so a diff names the types that changed)."""
    def records(mapping: dict, indent: str) -> str:
        rows = [f'{indent} {json.dumps(t)}: {json.dumps(r, default=str)}' for t, r in mapping.items()]
        return "{\n" + ",\n".join(rows) + f"\n{indent}}}"

    other = data.get("other")
    parts = [f' {json.dumps(k)}: {json.dumps(v)}' for k, v in data.items() if k not in ("records", "other")]
    if other is not None:
        parts.append(f' "other": {{"versions": {json.dumps(other["versions"])}, "records": '
                     f'{records(other["records"], "  ")}}}')
    parts.append(f' "records": {records(data["records"], " ")}')
    return "{\n" + ",\n".join(parts) + "\n}\n"


def compact(record: dict) -> dict:
    """What the page keeps of a record from the other transformers."""
    return {"build": record["build"]["ok"], "error": record["build"]["error"], "layout": record.get("layout"),
            "layers": record.get("layers"), "registered": record.get("registered"),
            "serves_ok": (record.get("serves") or {}).get("check", {}).get("ok"),
            "inferred": (record.get("serves") or {}).get("inferred"),
            "fits": (record.get("common_layout") or {}).get("fits")}


def other_survey(python: str) -> dict | None:
    """The other supported transformers' survey, run with its interpreter; the last one generated where that
    interpreter is missing; None where there is neither."""
    if not Path(python).exists():
        previous = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {}
        print(f"{python} not found: keeping the previous survey of the other transformers", file=sys.stderr)
        return previous.get("other")
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "other.json"
        subprocess.run([python, "-m", "attnlens.survey", "--json", str(out)], cwd=ROOT, check=True)
        data = json.loads(out.read_text())
    return {"versions": data["versions"], "records": {t: compact(r) for t, r in data["records"].items()}}


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m attnlens.survey", description=__doc__.split("\n")[0])
    parser.add_argument("types", nargs="*", help="survey these types only and print their records")
    parser.add_argument("--json", help="write the installed transformers' records here (no docs)")
    parser.add_argument("--other", default=str(OTHER_PYTHON),
                        help="the Python of the other supported transformers (default: %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.types)
    if args.types and not args.json:
        for record in survey(args.types, jobs=min(2, len(args.types))).values():
            print(json.dumps(record, indent=1, default=str))
        return
    here = installed()
    data = {"versions": here["versions"], "records": survey(args.types or here["types"])}
    if args.json:
        Path(args.json).write_text(dump(data))
        return
    data["other"] = other_survey(args.other)
    JSON_PATH.write_text(dump(data))
    MARKDOWN_PATH.write_text(render(data))


if __name__ == "__main__":
    main()
