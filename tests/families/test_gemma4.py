"""Gemma4, Gemma4Text, Gemma4Unified, Gemma4UnifiedText (attnlens/families/gemma4.py): what the shared identities cannot
see."""

import torch
from conftest import PROMPT, needs, tiny
from identities import N, trace

import attnlens
from attnlens.checks import failures, read_everything


def test_gemma4_layer_types_have_their_own_sizes_and_unscaled_scores():
    model = tiny("gemma4_text")
    sliding, full = model.layers[0].self_attn, model.layers[1].self_attn
    assert (sliding.num_heads, sliding.num_kv_heads, sliding.head_dim) == (4, 2, 16)
    assert (full.num_heads, full.num_kv_heads, full.head_dim) == (4, 1, 32)
    got = trace(
        model,
        lambda m: {
            "x": m.layers[1].attention_norm_output,
            "q": m.layers[1].self_attn.attention_queries,
            "k": m.layers[1].self_attn.attention_keys,
            "v": m.layers[1].self_attn.attention_values,
            "s": m.layers[1].self_attn.attention_scores,
        },
    )
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    assert torch.allclose(
        (got["q"] @ got["k"].repeat_interleave(4, 1).transpose(2, 3))[..., causal], got["s"][..., causal], atol=1e-5
    )  # no scale: q_norm and k_norm set it
    # attention_k_eq_v: the full layer's values are its key projection, v-normed (an RMSNorm without weights)
    with torch.no_grad():
        raw = full._module.k_proj(got["x"]).view(1, N, 1, 32)
    values = raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
    assert torch.allclose(got["v"], values.transpose(1, 2), atol=1e-5)
    assert "no v_proj" in model.support(1).notes["self_attn.attention_values"]


def test_gemma4_shared_layers_attend_with_earlier_keys_and_values():
    needs("gemma4_unified_text:kv_shared")
    model = tiny("gemma4_unified_text:kv_shared")
    got = trace(
        model,
        lambda m: {
            (i, name): getattr(m.layers[i].self_attn, name)
            for i in range(4)
            for name in ("attention_keys", "attention_values")
        },
    )
    for shared, source in ((2, 0), (3, 1)):
        for name in ("attention_keys", "attention_values"):
            assert torch.equal(got[shared, name], got[source, name])
        assert f"reused from layer {source}" in model.support(shared).notes["self_attn.attention_keys"]


def test_gemma4_per_layer_inputs_and_the_layer_scalar():
    """With per-layer inputs (and the key/value sharing that needs them), every identity holds, the last residual add
    with the per-layer-input branch recomputed from the block's own argument (Identities.block_arguments); by hand
    too."""
    model = attnlens.models.tiny(
        "gemma4_text",
        hidden_size_per_layer_input=8,
        num_hidden_layers=4,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
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
            h = h + block.post_per_layer_input_norm(
                block.per_layer_projection(block.act_fn(block.per_layer_input_gate(h)) * per_layer_input)
            )
        assert torch.allclose(h * 0.5, saved[(i, "layer_output")], atol=1e-5)
    assert torch.equal(saved[(2, "attention_keys")], saved[(0, "attention_keys")])


def test_gemma4_experts_branch_joins_beside_the_mlp():
    model = tiny("gemma4_text:moe")
    assert "experts branch" in model.support(0).notes["mlp.mlp_output"]
    assert model.support(0)["mlp.mlp_activation"] is None  # the dense MLP beside the experts has one
