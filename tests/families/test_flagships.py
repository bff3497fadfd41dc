"""Llama 4 (chunked and NoPE layers), Gemma 4 (per-layer sizes, shared keys and values, per-layer inputs), Gemma 3's
multimodal causal LM, and the latent-attention families (sizes, the lightning indexer, hybrids, LongCat-Flash's
paired sublayers): what the shared identities cannot see."""

import pytest
import torch
import transformers
from conftest import PROMPT, needs, tiny
from identities import trace

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.families.llama4 import Llama4
from attnlens.family import TINY_DEFAULTS
from attnlens.models import char_tokenizer, tiny_model

N = len(PROMPT)


def chunked(length, size, start=0):
    """Which keys each query sees on a chunked layer: causal, in its own chunk counted from position `start`."""
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return (k <= q) & ((k - start).div(size, rounding_mode="floor") == (q - start).div(size, rounding_mode="floor"))


# --- Llama 4 ------------------------------------------------------------------------------------------------------


def test_llama4_chunked_layers_see_only_their_chunk():
    model = tiny("llama4_text")
    size = model.config.attention_chunk_size
    assert [model.config.layer_types[i] for i in range(3)] == ["chunked_attention", "full_attention",
                                                               "chunked_attention"]
    got = trace(model, lambda m: {0: m.layers[0].self_attn.attention_probabilities,
                                  1: m.layers[1].self_attn.attention_probabilities})
    sees = chunked(N, size)
    assert ((got[0][0] > 0) == sees).all()  # exactly zero outside the chunk, positive inside
    assert ((got[1][0] > 0) == torch.ones(N, N, dtype=torch.bool).tril()).all()  # the NoPE layer sees everything
    assert "chunk of 4 positions" in model.support(0).notes["self_attn.attention_probabilities"]


def test_llama4_chunks_count_from_the_first_real_token():
    """Left padding shifts the chunks (transformers' chunked_overlay): the score function follows with key_mask."""
    model = tiny("llama4_text")
    prompts = [PROMPT, "Hi there"]
    got = trace(model, lambda m: {"q": m.layers[0].self_attn.attention_queries,
                                  "k": m.layers[0].self_attn.attention_keys,
                                  "s": m.layers[0].self_attn.attention_scores}, prompts)
    pad = N - len(prompts[1])
    key_mask = torch.ones(2, N)
    key_mask[1, :pad] = 0
    rebuilt = model.family.scores(model.layers[0].self_attn.heads, model.config, got["q"], got["k"], 0, key_mask)
    real = slice(pad, N)
    assert torch.allclose(rebuilt[1, :, real, real], got["s"][1, :, real, real], atol=1e-5)
    minimum = torch.finfo(got["s"].dtype).min
    assert torch.equal(got["s"][1, 0, real, real] > minimum / 2, chunked(N - pad, model.config.attention_chunk_size))


def test_llama4_nope_queries_are_read_after_temperature_tuning():
    model = tiny("llama4_text", floor_scale=4, attn_scale=0.5)  # binds within the test prompt
    got = trace(model, lambda m: {f"{i}{name}": getattr(m.layers[i], name) if name == "attention_norm_output" else
                                  getattr(m.layers[i].self_attn, name)
                                  for i in (0, 1) for name in ("attention_norm_output", "attention_queries")})
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
    config = transformers.Llama4Config(text_config={**TINY_DEFAULTS, **Llama4.tiny[2]},
                                       vision_config={"num_hidden_layers": 1, "hidden_size": 32,
                                                      "num_attention_heads": 2, "intermediate_size": 64})
    assert config.model_type == "llama4" and attnlens.registered()["llama4"] is attnlens.registered()["llama4_text"]
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = attnlens.StandardizedTransformer(transformers.AutoModelForCausalLM.from_config(config),
                                             tokenizer=char_tokenizer())
    assert type(model._module).__name__ == "Llama4ForCausalLM"
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[], [], []]


# --- Gemma 4 ------------------------------------------------------------------------------------------------------


def test_gemma4_layer_types_have_their_own_sizes_and_unscaled_scores():
    model = tiny("gemma4_text")
    sliding, full = model.layers[0].self_attn, model.layers[1].self_attn
    assert (sliding.num_heads, sliding.num_kv_heads, sliding.head_dim) == (4, 2, 16)
    assert (full.num_heads, full.num_kv_heads, full.head_dim) == (4, 1, 32)
    got = trace(model, lambda m: {"x": m.layers[1].attention_norm_output, "q": m.layers[1].self_attn.attention_queries,
                                  "k": m.layers[1].self_attn.attention_keys,
                                  "v": m.layers[1].self_attn.attention_values,
                                  "s": m.layers[1].self_attn.attention_scores})
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    assert torch.allclose((got["q"] @ got["k"].repeat_interleave(4, 1).transpose(2, 3))[..., causal],
                          got["s"][..., causal], atol=1e-5)  # no scale: q_norm and k_norm set it
    # attention_k_eq_v: the full layer's values are its key projection, v-normed (an RMSNorm without weights)
    with torch.no_grad():
        raw = full._module.k_proj(got["x"]).view(1, N, 1, 32)
    values = raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
    assert torch.allclose(got["v"], values.transpose(1, 2), atol=1e-5)
    assert "no v_proj" in model.support(1).notes["self_attn.attention_values"]


def test_gemma4_shared_layers_attend_with_earlier_keys_and_values():
    needs("gemma4_unified_text:kv_shared")
    model = tiny("gemma4_unified_text:kv_shared")
    got = trace(model, lambda m: {(i, name): getattr(m.layers[i].self_attn, name)
                                  for i in range(4) for name in ("attention_keys", "attention_values")})
    for shared, source in ((2, 0), (3, 1)):
        for name in ("attention_keys", "attention_values"):
            assert torch.equal(got[shared, name], got[source, name])
        assert f"reused from layer {source}" in model.support(shared).notes["self_attn.attention_keys"]


def test_gemma4_per_layer_inputs_and_the_layer_scalar():
    """With per-layer inputs (and the key/value sharing that needs them), every identity holds, the last residual add
    with the per-layer-input branch recomputed from the block's own argument (Family.block_arguments); by hand too."""
    model = attnlens.models.tiny("gemma4_text", hidden_size_per_layer_input=8, num_hidden_layers=4,
                                 num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention",
                                                                      "sliding_attention", "full_attention"])
    blocks = model._module.model.layers
    with torch.no_grad():
        for block in blocks:
            block.layer_scalar.fill_(0.5)
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, i) for i in range(4)] == [[]] * 4
    assert "per-layer-input branch" in model.support(0).notes["layer_output"]
    with torch.no_grad(), model.trace(PROMPT):
        inputs = list().save()
        for i in range(4):
            inputs.append(model.layers[i].inputs)
    for i, block in enumerate(blocks):
        per_layer_input = inputs[i][0][1]
        with torch.no_grad():
            h = saved[(i, "layer_mid")] + block.post_feedforward_layernorm(saved[(i, "mlp_output")])
            h = h + block.post_per_layer_input_norm(block.per_layer_projection(
                block.act_fn(block.per_layer_input_gate(h)) * per_layer_input))
        assert torch.allclose(h * 0.5, saved[(i, "layer_output")], atol=1e-5)
    assert torch.equal(saved[(2, "attention_keys")], saved[(0, "attention_keys")])


def test_gemma4_experts_branch_joins_beside_the_mlp():
    model = tiny("gemma4_text:moe")
    assert "experts branch" in model.support(0).notes["mlp.mlp_output"]
    assert model.support(0)["mlp.mlp_activation"] is None  # the dense MLP beside the experts has one


# --- Gemma 3 and Gemma 4 as multimodal causal LMs -------------------------------------------------------------------


@pytest.mark.parametrize(("case", "text"), [("gemma3", "gemma3_text"), ("gemma4", "gemma4_text")])
def test_multimodal_types_serve_their_language_model(case, text):
    """`AutoModelForCausalLM` builds the ...ForConditionalGeneration class: the same blocks under
    model.language_model, with the text config's windows; the text family's values, unchanged."""
    model, plain = tiny(case), tiny(text)
    assert type(model._module).__name__.endswith("ForConditionalGeneration")
    assert model.family.layers == "model.language_model.layers"
    assert [model.family.sliding_window(model.config, i) for i in range(3)] == \
        [plain.family.sliding_window(plain.config, i) for i in range(3)] != [None] * 3
    notes, text_notes = model.support(0).notes, plain.support(0).notes
    assert notes["self_attn.attention_probabilities"].startswith(text_notes["self_attn.attention_probabilities"])
    assert "media" in notes["self_attn.attention_probabilities"]


# --- latent attention -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("case", "layer", "sizes"), [
    ("youtu", 0, (4, 4, 24, 16)), ("minicpm3", 0, (4, 4, 24, 16)), ("kimi_linear", 1, (4, 4, 24, 16)),
    ("dots3_note_text", 0, (4, 4, 24, 16)), ("dots3_note_text", 1, (2, 2, 24, 8)), ("longcat_flash", 0, (4, 4, 24, 16)),
])
def test_latent_attention_sizes(case, layer, sizes):
    """num_heads, num_kv_heads (kv_b_proj expands the latent to every head), qk_head_dim, head_dim (v_head_dim), read
    per layer (dots.3 Note's sliding layers have their own), and the tensors have them."""
    needs(case)
    model = tiny(case)
    attn = model.layers[layer].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.qk_head_dim, attn.head_dim) == sizes
    got = trace(model, lambda m: {"k": m.layers[layer].self_attn.attention_keys,
                                  "v": m.layers[layer].self_attn.attention_values})
    assert got["k"].shape == (1, sizes[1], N, sizes[2]) and got["v"].shape == (1, sizes[1], N, sizes[3])


@pytest.mark.parametrize("case", ["deepseek_v32", "glm_moe_dsa"])
def test_the_indexer_masks_the_keys_it_does_not_choose(case):
    """With index_topk below the prompt's length the pattern is the softmax over the chosen keys only: exactly zero
    elsewhere, and the family's (causal) score function equal on the chosen keys. sdpa's rebuild applies the model's
    own mask, so it is zero outside that run's own choice. On GLM-MoE-DSA's "shared" layer 1 the choice is layer 0's."""
    model = tiny(case, index_topk=4)
    sees = indexer_choice(model)
    assert not sees.all()  # the choice binds
    read = lambda m: {(i, name): getattr(m.layers[i].self_attn, name) for i in (0, 1)  # noqa: E731
                      for name in ("attention_queries", "attention_keys", "attention_scores",
                                   "attention_probabilities")}
    got = trace(model, read)
    for layer in (0, 1) if case == "glm_moe_dsa" else (0,):
        probs, scores = got[layer, "attention_probabilities"], got[layer, "attention_scores"]
        assert ((probs[0] > 0) == sees).all()
        assert torch.allclose(scores.softmax(-1), probs, atol=1e-6)
        rebuilt = model.family.scores(model.layers[layer].self_attn.heads, model.config,
                                      got[layer, "attention_queries"], got[layer, "attention_keys"], layer)
        assert torch.allclose(rebuilt[..., sees], scores[..., sees], atol=1e-5)
    assert "index_topk=4" in model.support(0).notes["self_attn.attention_probabilities"]
    sdpa = attnlens.StandardizedTransformer(tiny_model(case, index_topk=4, attn_implementation="sdpa"),
                                            tokenizer=char_tokenizer(), rebuild_patterns=True)
    rebuilt = trace(sdpa, lambda m: {"p": m.layers[0].self_attn.attention_probabilities})["p"]
    # sdpa's run chooses for itself: ties in the indexer's scores may break otherwise than under eager
    assert ((rebuilt[0] > 0) == indexer_choice(sdpa)).all()
    assert torch.allclose(rebuilt.sum(-1), torch.ones(1, 4, N), atol=1e-5)


def indexer_choice(model):
    """Which keys layer 0's indexer lets each query see (chosen, and causal)."""
    with torch.no_grad(), model.trace(PROMPT):
        chosen = model.layers[0].self_attn.indexer.output.save()
    picked = torch.zeros(N, N, dtype=torch.bool).scatter(-1, chosen[0].long(), True)
    return picked & torch.ones(N, N, dtype=torch.bool).tril()


@pytest.mark.parametrize(("case", "linear"), [("kimi_linear", 0), ("bailing_hybrid", 2)])
def test_hybrid_linear_layers_say_why(case, linear):
    needs(case)
    model = tiny(case)
    report = model.support(linear)
    for name in ("attention_queries", "attention_probabilities", "attention_head_outputs"):
        assert "Kimi Delta Attention" in report[f"self_attn.{name}"]
    assert report["self_attn.attention_premix"] is None and report["self_attn.attention_output"] is None
    assert model.support(1)["self_attn.attention_probabilities"] is None


def test_head_scalar_gates_take_only_constant_assignments():
    needs("dots3_note_text")
    model = tiny("dots3_note_text")
    got = trace(model, lambda m: {"g": m.layers[0].self_attn.attention_gate})
    assert got["g"].shape == (1, N, 4, 16) and torch.equal(got["g"], got["g"][..., :1].expand_as(got["g"]))
    with pytest.raises(Exception, match="constant along the head's channels"):
        with torch.no_grad(), model.trace(PROMPT):
            gate = model.layers[0].self_attn.attention_gate
            model.layers[0].self_attn.attention_gate = torch.rand_like(gate)


def test_longcat_serves_the_first_of_each_blocks_two_attentions():
    model = tiny("longcat_flash")
    block = model._module.model.layers[0]
    got = trace(model, lambda m: {"x": m.layers[0].attention_norm_output,
                                  "out": m.layers[0].self_attn.attention_output})
    with torch.no_grad():
        rotary = type(model._module.model.rotary_emb)(model.config)
        mask = model.family.mask(N, N, model.config, 0)
        first = block.self_attn[0](got["x"], rotary(got["x"], torch.arange(N)[None]), mask)[0]
    assert torch.allclose(got["out"], first, atol=1e-5)
    assert "self_attn[1] is not served" in model.support(0).notes["self_attn.attention_queries"]
    assert "MoE shortcut" in model.support(0).notes["mlp.mlp_output"]
