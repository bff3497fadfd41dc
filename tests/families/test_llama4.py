"""Llama4 (attnlens/families/llama4.py): what the shared identities cannot see."""

import torch
import transformers
from conftest import PROMPT, tiny
from identities import N, trace

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.families.llama4 import Llama4
from attnlens.family import TINY_DEFAULTS
from attnlens.models import char_tokenizer


def chunked(length, size, start=0):
    """Which keys each query sees on a chunked layer: causal, in its own chunk counted from position `start`."""
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return (k <= q) & ((k - start).div(size, rounding_mode="floor") == (q - start).div(size, rounding_mode="floor"))


def test_llama4_chunked_layers_see_only_their_chunk():
    model = tiny("llama4_text")
    size = model.config.attention_chunk_size
    assert [model.config.layer_types[i] for i in range(3)] == [
        "chunked_attention",
        "full_attention",
        "chunked_attention",
    ]
    got = trace(
        model,
        lambda m: {0: m.layers[0].self_attn.attention_probabilities, 1: m.layers[1].self_attn.attention_probabilities},
    )
    sees = chunked(N, size)
    assert ((got[0][0] > 0) == sees).all()  # exactly zero outside the chunk, positive inside
    assert ((got[1][0] > 0) == torch.ones(N, N, dtype=torch.bool).tril()).all()  # the NoPE layer sees everything
    assert "chunk of 4 positions" in model.support(0).notes["self_attn.attention_probabilities"]


def test_llama4_chunks_count_from_the_first_real_token():
    """Left padding shifts the chunks (transformers' chunked_overlay): the score function follows with key_mask."""
    model = tiny("llama4_text")
    prompts = [PROMPT, "Hi there"]
    got = trace(
        model,
        lambda m: {
            "q": m.layers[0].self_attn.attention_queries,
            "k": m.layers[0].self_attn.attention_keys,
            "s": m.layers[0].self_attn.attention_scores,
        },
        prompts,
    )
    pad = N - len(prompts[1])
    key_mask = torch.ones(2, N)
    key_mask[1, :pad] = 0
    rebuilt = model.family.score_function().scores(
        model.layers[0].self_attn.heads, model.config, got["q"], got["k"], 0, key_mask
    )
    real = slice(pad, N)
    assert torch.allclose(rebuilt[1, :, real, real], got["s"][1, :, real, real], atol=1e-5)
    minimum = torch.finfo(got["s"].dtype).min
    assert torch.equal(got["s"][1, 0, real, real] > minimum / 2, chunked(N - pad, model.config.attention_chunk_size))


def test_llama4_nope_queries_are_read_after_temperature_tuning():
    model = tiny("llama4_text", floor_scale=4, attn_scale=0.5)  # binds within the test prompt
    got = trace(
        model,
        lambda m: {
            f"{i}{name}": getattr(m.layers[i], name)
            if name == "attention_norm_output"
            else getattr(m.layers[i].self_attn, name)
            for i in (0, 1)
            for name in ("attention_norm_output", "attention_queries")
        },
    )
    module = model.layers[1].self_attn._module
    positions = torch.arange(N, dtype=torch.float32)
    tuned = torch.log1p(torch.floor((positions + 1) / 4)) * 0.5 + 1
    with torch.no_grad():
        plain = module.q_proj(got["1attention_norm_output"]).view(1, N, 4, 16)
    assert torch.allclose(got["1attention_queries"], (plain * tuned[None, :, None, None]).transpose(1, 2), atol=1e-5)
    # the rotary layer's queries pass the L2 QK-norm: unit root-mean-square per head
    assert torch.allclose(got["0attention_queries"].pow(2).mean(-1), torch.ones(1, 4, N), atol=1e-3)
    assert "temperature-tuned" in model.support(1).notes["self_attn.attention_queries"]
    assert "qk_norm" in model.support(0).notes["self_attn.attention_queries"]


def test_llama4_moe_output_is_read_and_assigned_per_token():
    model = attnlens.models.tiny("llama4_text")  # edited below: not the session's shared model
    assert model.family.moe_layer(model.config, 0) and not model.family.moe_layer(model.config, 2)
    out = trace(model, lambda m: {"out": m.layers[0].mlp.mlp_output})["out"]
    assert out.shape == (1, N, 64) and out.abs().sum() > 0
    with torch.no_grad(), model.trace(PROMPT):
        mid = model.layers[0].layer_mid.save()
        model.layers[0].mlp.mlp_output = torch.zeros(1, N, 64)
        after = model.layers[0].layer_output.save()
    assert torch.allclose(after, mid)
    assert "mlp.experts" in model.support(0)["mlp.mlp_activation"]
    assert model.support(2)["mlp.mlp_activation"] is None  # the dense layer's activation_fn


def test_llama4_composite_type_loads_as_the_text_model():
    config = transformers.Llama4Config(
        text_config={**TINY_DEFAULTS, **Llama4.tiny[2]},
        vision_config={"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64},
    )
    released, text = attnlens.registered()["llama4"], attnlens.registered()["llama4_text"]
    assert config.model_type == "llama4" and released is not text and issubclass(released, text)  # vLLM's paths differ
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = attnlens.StandardizedTransformer(
        transformers.AutoModelForCausalLM.from_config(config), tokenizer=char_tokenizer()
    )
    assert type(model._module).__name__ == "Llama4ForCausalLM"
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[], [], []]
