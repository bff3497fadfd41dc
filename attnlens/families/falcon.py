"""Falcon: four layouts of one attention module, its own arithmetic up to transformers 5.24, and parallel blocks.

The fused `query_key_value` splits three ways: multi-query (`multi_query=True`, the default: one key/value head),
the old multi-head layout (`multi_query=False`: per head [q, k, v]) and the new decoder architecture
(`new_decoder_architecture=True`: `num_kv_heads` groups of [q..., k, v]).

transformers 5.25 and later call the shared attention interface, with a file-local eager function: the six attention
values are read there as on Llama, keys and values before repetition (`num_kv_heads` of them, one on multi-query),
scores `q·k * (1 / sqrt(d)) + mask`. `FalconModel` folds ALiBi (`alibi=True`, no rotary; Bloom's slopes rounded to
bfloat16, `slopes.bfloat16() * position`) into the mask as `alibi / sqrt(d)`, so eager and sdpa add it once.

transformers 5.24 and earlier run Falcon's own arithmetic (`_split_heads`), which the family reads where it is. In the
new architecture `_split_heads` broadcasts each key/value head to its group before anything is held, so the keys and
values are a de-duplicated copy of the broadcast tensors (the first head of each group), and assigning them
re-broadcasts to every head of the group. Scores are built in place with `@`, `/=` and `*=`, none of them an nnsight
operation, so they are read where they are final: the softmax's input (`scores + attention_mask`, formed inline).
Rotary layouts: `q @ k^T`, divided in place by sqrt(d), plus the mask; no dropout. ALiBi: `(q @ k^T + alibi)`,
multiplied in place by 1/sqrt(d), plus the mask with `alibi / sqrt(d)` folded in: the bias enters twice under eager,
once under sdpa. The two branches bind different operations (queries after the rotary embedding or straight from the
split; `F_softmax_0` or `F_softmax_1`; the pattern without or with dropout; the mix per head or folded into the
batch), but the same catalogue order: the keys and values come from the cache update, after the queries, in both.
There, keys and values are read from the cache update, so they are the whole cache under generate; a forward run with
`use_cache=False` skips the update and cannot serve them.

What reorders `order()` is the block: no `layer_mid` on parallel blocks, and the new architecture's MLP norm runs
before attention. `parallel_attn` (and always the new architecture) runs attention and MLP side by side on the block
input: there is no residual stream between them, and the block adds the attention output to the MLP's output in place
(`mlp_output += attention_output`), so `mlp_output` is a snapshot taken before that add.

On vLLM (its own FalconForCausalLM, both architectures): attention and the MLP return `(output, bias)` and the block
adds the bias later, so `attention_output` and `mlp_output` are copies with the bias added; a sequential block adds
the attention output to its input in place, so the residual stream is read as copies there. vLLM's kernel adds ALiBi
once, with float32 slopes, where transformers adds it with bfloat16 slopes (twice under 5.24's eager attention): the
score function computes what each engine's kernel does (its `ScoreFunction.engine`).
"""

import math

import torch

from ..family import Family, Tiny, VLLMLayout
from ..locations import INTERFACE_CALL, Derived, ModuleInput, ModuleOutput, Operation, OutputField
from ..locations.views import snapshot
from ..parts import scoring
from ..parts.alibi import alibi_slopes, key_positions
from ..parts.fused import FusedQKV
from ..parts.mirrored import mirrored
from ..parts.parallel import PARALLEL_NO_MID, shared_norm_note
from ..parts.sizes import Sizes
from ..parts.source import transformers_defines


def own_arithmetic() -> bool:
    """Whether the installed transformers runs Falcon's own attention arithmetic (5.24 and earlier), not the shared
    attention interface (5.25 and later)."""
    return transformers_defines("falcon.modeling_falcon", "FalconAttention", "_split_heads")


def _groups(envoy):
    module = envoy._module
    return module.num_heads // module.num_kv_heads


def _first_of_group(envoy, broadcast):
    # a copy: a view of the first head alone would take in-place edits on one head of each group only
    return broadcast[:, :: _groups(envoy)].clone()


def _rebroadcast(envoy, old, new):
    return new.repeat_interleave(_groups(envoy), dim=1)


def _merged_heads(envoy, flat):
    """The eager ALiBi mix, [batch * heads, seq, dim], as [batch, seq, heads, dim] (a view)."""
    heads = envoy._module.num_heads
    return flat.view(flat.shape[0] // heads, heads, *flat.shape[1:]).transpose(1, 2)


def _unmerged_heads(envoy, old, new):
    return new.transpose(1, 2).reshape(old.shape)


DEDUPLICATED = (
    "it is a de-duplicated copy (the forward holds each key/value head broadcast to its whole group, "
    "never one per group)"
)


def _plus_bias(envoy, output):
    """vLLM's Falcon returns (output, bias) from attention and the MLP (`skip_bias_add`), adding the bias later."""
    out, bias = output
    return (out.clone() if bias is None else out + bias)[None]


def _minus_bias(envoy, old, new):
    bias = old[1]
    return (new[0] if bias is None else new[0] - bias, bias)


def _stream_copy(source):
    """The residual stream of vLLM's sequential block, which adds the attention output to it in place: a copy."""
    return Derived(
        source,
        lambda envoy, value: value[None].clone(),
        lambda envoy, old, new: new[0],
        in_place=False,
        note="a copy: vLLM's sequential Falcon block adds the attention output to this tensor in place "
        "(assign it to edit)",
        why_not="it is a copy: vLLM's sequential Falcon block adds the attention output to it in place",
    )


def _keys_values(new_architecture: bool):
    update = Operation(("layer_past_update_0",), item=0, anchor="layer_past.update(")
    values = Operation(("layer_past_update_0",), item=1, anchor="layer_past.update(")
    if new_architecture:
        return tuple(
            Derived(source, _first_of_group, _rebroadcast, name, in_place=False, why_not=DEDUPLICATED)
            for source, name in ((update, "attention_keys"), (values, "attention_values"))
        )
    return update, values


class Falcon(Family):
    model_types = ("falcon",)
    tiny = Tiny(
        "FalconConfig",
        "FalconForCausalLM",
        {"ffn_hidden_size": 128, "num_key_value_heads": None, "intermediate_size": None},
        layouts={
            "multihead": {"multi_query": False, "parallel_attn": False},
            "new_architecture": {"new_decoder_architecture": True, "num_kv_heads": 2},
            "alibi": {"alibi": True, "multi_query": False, "parallel_attn": False, "bias": True},
        },
    )
    layers = "transformer.h"
    embed_tokens = "transformer.word_embeddings"
    final_norm = "transformer.ln_f"
    attention = "self_attention"
    output_projection = "dense"
    fused_qkv = FusedQKV("query_key_value", "groups")  # all three splits: kv groups of [q..., k, v]
    activation = "act"
    down_projection = "dense_4h_to_h"
    mlp_norm = "post_attention_layernorm"  # on sequential blocks, the only ones with a layer_mid
    vllm = VLLMLayout(
        model_types=("falcon",),  # vLLM's own FalconForCausalLM
        tiny={"hidden_size": 128, "ffn_hidden_size": 512},  # head size 32; vLLM builds the MLP at 4 x hidden
    )
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=("num_kv_heads",), scale=("inv_norm_factor",))

    @staticmethod
    def parallel(config) -> bool:
        return bool(config.parallel_attn or config.new_decoder_architecture)

    @staticmethod
    def norms(config) -> tuple[str, str]:
        """The norm in front of attention and the one in front of the MLP (the same one on a one-norm parallel
        block)."""
        if config.new_decoder_architecture and config.num_ln_in_parallel_attn in (None, 2):
            return "ln_attn", "ln_mlp"
        if Falcon.parallel(config):
            return "input_layernorm", "input_layernorm"
        return "input_layernorm", "post_attention_layernorm"

    #: The kind of FalconConfig()'s layout: multi-query, rotary, one shared norm in front of a parallel block.
    DEFAULT_KIND = frozenset({"parallel", "eager", "norms=input_layernorm+input_layernorm"})

    def locations(self):
        """The default layout's (`DEFAULT_KIND`, eager); every layout's: `kind_locations`."""
        return self._layout_locations(self.DEFAULT_KIND)

    def layer_kind(self, config, layer):
        """Falcon's layout is the config's: which of these hold, and which norms the block has."""
        flags = {
            "alibi": config.alibi,
            "new_architecture": config.new_decoder_architecture,
            "parallel": self.parallel(config),
            "eager": config._attn_implementation == "eager",
        }
        return frozenset({name for name, on in flags.items() if on} | {"norms=" + "+".join(self.norms(config))})

    def kind_locations(self, kind, config, engine):
        """Falcon's layout follows from its kind alone (`layer_kind` names every flag that sets it)."""
        return self._layout_locations(kind) if engine == "transformers" else self._vllm_layout_locations(kind)

    def _vllm_layout_locations(self, kind):
        """vLLM's FalconDecoderLayer has the same modules; it returns (output, bias) from attention and the MLP, and on
        a sequential block adds attention's output to its input in place (`residual += attention_output`)."""
        from ..locations import ModuleArgument
        from ..locations.vllm import batched

        eager = {**self._layout_locations(kind), "mlp_output": ModuleOutput()}
        stream = batched if "parallel" in kind else _stream_copy
        with_bias = {
            "in_place": False,
            "note": "the module's output plus its bias, which vLLM's Falcon adds after the "
            "module returns (a copy: assign it)",
            "why_not": "it is a copy: vLLM's Falcon adds the bias after the module returns",
        }
        return {
            **mirrored(self, eager, own_port=True),
            "embeddings": stream(ModuleOutput(self.embed_tokens)),
            "layer_input": stream(ModuleArgument("", 1)),
            "attention_output": Derived(ModuleOutput(""), _plus_bias, _minus_bias, **with_bias),
            "mlp_output": Derived(ModuleOutput(""), _plus_bias, _minus_bias, **with_bias),
            "layer_output": stream(ModuleOutput("", 0)),
        }

    def _layout_locations(self, kind):
        (norms,) = (tag.removeprefix("norms=") for tag in kind if tag.startswith("norms="))
        attention_norm, mlp_norm = norms.split("+")
        keys, values = _keys_values("new_architecture" in kind)
        eager = "eager" in kind
        if not own_arithmetic():
            attention = {  # what the common layout reads at the attention function's call
                name: location
                for name, location in super().locations().items()
                if isinstance(location, Operation) and location.path[0] == INTERFACE_CALL
            }
        elif "alibi" in kind:
            attention = {
                "attention_queries": Operation(("query_layer_0",), anchor="query_layer.transpose(1, 2)"),
                "attention_keys": keys,
                "attention_values": values,
                "attention_scores": Operation(("F_softmax_1",), "arg", 0, anchor="attention_logits + attention_mask"),
                "attention_probabilities": Operation(("attention_probs_2",), anchor="self.attention_dropout("),
                "attention_head_outputs": (
                    Derived(
                        Operation(("attn_output_10",), anchor="attention_probs_reshaped @ value_layer"),
                        _merged_heads,
                        _unmerged_heads,
                        "attention_head_outputs",
                    )
                    if eager
                    else Operation(("attn_output_7",), anchor="attn_output.transpose(1, 2)")
                ),  # sdpa's branch
            }
        else:
            queries = Operation(("apply_rotary_pos_emb_0",), item=0, anchor="apply_rotary_pos_emb(")
            attention = {
                "attention_queries": queries,
                "attention_keys": keys,
                "attention_values": values,
                "attention_scores": Operation(("F_softmax_0",), "arg", 0, anchor="attention_scores + attention_mask"),
                "attention_probabilities": Operation(("attention_scores_2",), anchor="F.softmax("),
                "attention_head_outputs": Operation(("attn_output_3",), anchor="permute(0, 2, 1, 3)"),
            }
        before = {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            "attention_norm_output": ModuleOutput(attention_norm),
        }
        if "parallel" not in kind:
            mlp_output = ModuleOutput()
            middle = {"layer_mid": ModuleInput(mlp_norm), "mlp_norm_output": ModuleOutput(mlp_norm)}
        else:
            # the block adds the attention output to the MLP's output in place: snapshot it
            mlp_output = snapshot(
                ModuleOutput(),
                label="mlp_output",
                why="it is a snapshot: the block adds the attention output to the MLP's output "
                "in place right after, so the live tensor is not the MLP's output",
            )
            if mlp_norm == attention_norm:  # one shared norm: read as the MLP receives it (as Phi does)
                middle = {"mlp_norm_output": ModuleInput(self.mlp)}
            else:  # the new architecture's own MLP norm runs before attention
                before["mlp_norm_output"] = ModuleOutput(mlp_norm)
                middle = {}
        return {
            **before,
            **attention,
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput("", 0),
            **middle,
            "mlp_input": ModuleInput(self.mlp),
            "mlp_activation": ModuleOutput(self.activation),
            "mlp_neurons": ModuleInput(self.down_projection),
            "mlp_output": mlp_output,
            "layer_output": ModuleOutput("", 0),
            "final_norm_output": ModuleOutput(self.final_norm),
            "logits": OutputField("logits"),
        }

    def _vllm_notes(self, config):
        notes = {"attention_scores": "q·k / sqrt(d) + mask"}
        attention_norm, mlp_norm = self.norms(config)
        if self.parallel(config) and attention_norm == mlp_norm:
            notes["mlp_norm_output"] = shared_norm_note(attention_norm)
        return notes

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            return None

        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            if self.engine == "vllm" and config.alibi:
                return self.vllm_alibi_scores(heads, config, queries, keys, layer, key_mask)
            if self.engine == "transformers" and not own_arithmetic():
                return self.interface_scores(heads, config, queries, keys, layer, key_mask)
            groups = queries.shape[1] // keys.shape[1]
            scores = queries @ keys.repeat_interleave(groups, dim=1).transpose(-1, -2)
            num_queries, num_keys = scores.shape[-2:]
            visible = self.mask(num_queries, num_keys, config, layer, key_mask, queries.dtype, queries.device) == 0
            minimum = torch.finfo(queries.dtype).min  # FalconModel's mask, in the model's dtype
            if not config.alibi:
                scores = scores / math.sqrt(heads.head_dim)
                return scores + torch.where(
                    visible, torch.zeros((), dtype=queries.dtype, device=scores.device), minimum
                )
            if scores.dtype in (torch.float16, torch.bfloat16):
                scores = scores.to(torch.float32)
            alibi = self.family.alibi(queries.shape[1], num_keys, key_mask, queries.dtype, queries.device)
            scores = (scores + alibi) * heads.scale
            # FalconModel folds alibi / sqrt(d) into the mask as well
            return scores + torch.masked_fill(alibi / math.sqrt(heads.head_dim), ~visible, minimum)

        def interface_scores(self, heads, config, queries, keys, layer, key_mask=None):
            """transformers 5.25's: `q·k * scale` plus the mask, into which FalconModel folds `alibi / sqrt(d)` (masked
            entries the model dtype's minimum alone). The keys repeated as transformers repeats them and one product,
            as its eager function does: bit for bit on decode steps too, where the grouped product is not."""
            groups = queries.shape[1] // keys.shape[1]
            scores = torch.matmul(queries, self.repeat_kv(keys, groups).transpose(2, 3)) * heads.scale
            mask = self.mask(queries.shape[2], keys.shape[2], config, layer, key_mask, scores.dtype, scores.device)
            if config.alibi:
                alibi = self.family.alibi(queries.shape[1], keys.shape[2], key_mask, queries.dtype, queries.device)
                mask = torch.where(mask == 0, alibi / math.sqrt(heads.head_dim), mask)
            return scores + mask

        def alibi_slopes(self, config, layer: int) -> torch.Tensor | None:
            """The per-head ALiBi slopes vLLM's kernel holds (added times the key's distance, after the scale), float32:
            Bloom's times 1 / sqrt(d); None without ALiBi."""
            if not config.alibi:
                return None
            return alibi_slopes(config.num_attention_heads) * (
                1.0 / math.sqrt(config.hidden_size // config.num_attention_heads)
            )

        def vllm_alibi_scores(self, heads, config, queries, keys, layer, key_mask=None):
            """The scores vLLM's ALiBi kernel takes the softmax of: `q·k / sqrt(d)` plus the bias once, Bloom's float32
            slopes times 1 / sqrt(d) times the key position (vLLM's kernel counts it from the query, which shifts each
            row by a constant: the same pattern)."""
            groups = queries.shape[1] // keys.shape[1]
            scores = queries @ keys.repeat_interleave(groups, dim=1).transpose(-1, -2) * heads.scale
            slopes = self.alibi_slopes(config, layer).to(queries.device)
            bias = slopes[:, None] * key_positions(keys.shape[2], key_mask, queries.device)[:, None, :]
            scores = scores + bias[:, :, None].to(scores.dtype)
            return scores + self.mask(
                queries.shape[2], keys.shape[2], config, layer, key_mask, scores.dtype, scores.device
            )

    def alibi(self, num_heads, num_keys, key_mask=None, dtype=torch.float32, device=None) -> torch.Tensor:
        """FalconModel's ALiBi, [batch or 1, heads, 1, key]: Bloom's slopes in bfloat16 times the key position."""
        positions = key_positions(num_keys, key_mask, device)
        slopes = alibi_slopes(num_heads, positions.device)[:, None].bfloat16()
        return (slopes * positions[:, None, :]).to(dtype)[:, :, None]

    def unavailable(self, config, layer, engine="transformers"):
        reasons = super().unavailable(config, layer, engine)
        if self.parallel(config):
            attention_norm, mlp_norm = self.norms(config)
            norms = (
                f"one shared {attention_norm}"
                if attention_norm == mlp_norm
                else f"{attention_norm} and {mlp_norm} respectively"
            )
            reasons["layer_mid"] = PARALLEL_NO_MID.format(norms=norms)
        if engine != "transformers" or not own_arithmetic():
            return reasons
        implementation = config._attn_implementation
        if implementation not in ("eager", "sdpa"):
            for name in ("attention_queries", "attention_keys", "attention_values", "attention_head_outputs"):
                reasons[name] = (
                    f"the {implementation!r} attention is FalconFlashAttention2, whose own forward "
                    f"attnlens does not read (it reads FalconAttention, which runs eager and sdpa); "
                    f"load with attn_implementation='eager' or 'sdpa'"
                )
        if not config.use_cache:
            for name in ("attention_keys", "attention_values"):
                reasons[name] = (
                    "read at the cache update, which config.use_cache=False skips; load with "
                    "use_cache=True (the default)"
                )
        return reasons

    def verify(self, model, layer, layer_module, attention_module):
        # 5.24 runs FalconAttention.forward under eager and sdpa only; 5.25 runs it under every implementation
        if not own_arithmetic() or model.config._attn_implementation in ("eager", "sdpa"):
            super().verify(model, layer, layer_module, attention_module)

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if engine == "vllm":
            return {**notes, **self._vllm_notes(config)}
        if self.parallel(config):
            notes["mlp_output"] = (
                "a snapshot (copy) of the MLP's output, taken before the block adds the attention "
                "output to it in place: assign it, in-place edits do not land"
            )
            attention_norm, mlp_norm = self.norms(config)
            if attention_norm == mlp_norm:
                notes["mlp_norm_output"] = shared_norm_note(attention_norm)
        if not own_arithmetic():
            if config.alibi:
                notes["attention_scores"] = (
                    "q·k / sqrt(d) + mask, where FalconModel has folded the ALiBi bias into the mask as alibi / "
                    "sqrt(d) (Bloom's slopes rounded to bfloat16): eager and sdpa add it once"
                )
            return notes
        cache = (
            "read at the cache update (the whole cache under generate); a forward called with use_cache=False "
            "never forms it"
        )
        notes["attention_keys"] = notes["attention_values"] = cache
        if config.new_decoder_architecture:
            dedup = (
                "a de-duplicated copy: _split_heads broadcasts each key/value head to its group, so the forward "
                "never holds them before repetition; this is the first head of each group. Assign it (it is "
                "re-broadcast to the group); in-place edits do not land"
            )
            notes["attention_keys"] = notes["attention_values"] = f"{dedup}; {cache}"
        if config.alibi:
            notes["attention_scores"] = (
                "(q·k + alibi) / sqrt(d) + alibi / sqrt(d) + mask: the ALiBi bias enters "
                "twice under eager (FalconModel also folds it into the mask); sdpa adds it "
                "once. Slopes are Bloom's, rounded to bfloat16; float32 in a "
                "half-precision model"
            )
            notes["attention_head_outputs"] = "a view of the mix transformers holds as batch*heads, seq, head_dim"
        else:
            notes["attention_scores"] = "q·k / sqrt(d) + mask; the softmax's input (the scores are scaled in place)"
            notes["attention_probabilities"] = "the softmax's output: Falcon applies no attention dropout with rotary"
        return notes
