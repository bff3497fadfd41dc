"""Latent attention (DeepSeek-V2/V3 and the families that reuse it): sizes, and keys and values expanded per head from
the latent.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import PROMPT, needs, tiny
from identities import N, trace


@pytest.mark.parametrize(
    ("case", "layer", "sizes"),
    [
        ("youtu", 0, (4, 4, 24, 16)),
        ("minicpm3", 0, (4, 4, 24, 16)),
        ("kimi_linear", 1, (4, 4, 24, 16)),
        ("dots3_note_text", 0, (4, 4, 24, 16)),
        ("dots3_note_text", 1, (2, 2, 24, 8)),
        ("longcat_flash", 0, (4, 4, 24, 16)),
    ],
)
def test_latent_attention_sizes(case, layer, sizes):
    """num_heads, num_kv_heads (kv_b_proj expands the latent to every head), qk_head_dim, head_dim (v_head_dim), read
    per layer (dots.3 Note's sliding layers have their own), and the tensors have them."""
    needs(case)
    model = tiny(case)
    attn = model.layers[layer].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.qk_head_dim, attn.head_dim) == sizes
    got = trace(
        model,
        lambda m: {"k": m.layers[layer].self_attn.attention_keys, "v": m.layers[layer].self_attn.attention_values},
    )
    assert got["k"].shape == (1, sizes[1], N, sizes[2]) and got["v"].shape == (1, sizes[1], N, sizes[3])


@pytest.mark.parametrize("case", ["deepseek_v2", "deepseek_v3"])
def test_latent_keys_and_values_are_expanded_per_head_from_the_latent(case):
    model = tiny(case)
    attn = model.layers[0].self_attn
    module, config = attn._module, model.config
    nope, rope, v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    assert (attn.num_heads, attn.num_kv_heads, attn.qk_head_dim, attn.head_dim) == (4, 4, nope + rope, v_dim)
    got = trace(
        model,
        lambda m: {
            "x": m.layers[0].attention_norm_output,
            "q": m.layers[0].self_attn.attention_queries,
            "k": m.layers[0].self_attn.attention_keys,
            "v": m.layers[0].self_attn.attention_values,
        },
    )
    assert got["q"].shape[-1] == got["k"].shape[-1] == nope + rope and got["v"].shape[-1] == v_dim
    # Rebuilt from the latent the way MLA defines it: kv_b_proj(norm(latent)) split into each head's key and value.
    with torch.no_grad():
        latent = module.kv_a_proj_with_mqa(got["x"])[..., : config.kv_lora_rank]
        expanded = module.kv_b_proj(module.kv_a_layernorm(latent)).view(1, len(PROMPT), 4, nope + v_dim).transpose(1, 2)
    assert torch.allclose(got["k"][..., :nope], expanded[..., :nope], atol=1e-5)
    assert torch.allclose(got["v"], expanded[..., nope:], atol=1e-5)
    # The rotary part of the key is one slice shared by every head; the rest differs per head.
    shared = got["k"][..., nope:]
    assert torch.equal(shared, shared[:, :1].expand_as(shared))
    assert not torch.allclose(got["k"][:, 0, :, :nope], got["k"][:, 1, :, :nope])
