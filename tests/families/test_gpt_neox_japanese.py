"""GPTNeoXJapanese (attnlens/families/gpt_neox_japanese.py): what the shared identities cannot see."""

import torch
from conftest import PROMPT, tiny
from identities import failures, read_everything, saved_for

import attnlens
from attnlens.models import char_tokenizer, tiny_model


def biased_japanese():
    """A tiny GPT-NeoX-Japanese whose last block's dense_bias is not zero (a fresh model's is)."""
    model = tiny_model("gpt_neox_japanese")
    layers = model.gpt_neox_japanese.layers
    assert [layer.attention.dense_bias is not None for layer in layers] == [False, False, True]
    with torch.no_grad():
        layers[-1].attention.dense_bias.normal_(0, 1)
    return attnlens.StandardizedTransformer(model, tokenizer=char_tokenizer())


def test_japanese_last_layer_adds_its_attention_bias_in_the_block():
    model = biased_japanese()
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[], [], []]
    last = model.num_layers - 1
    bias = model.layers[last].self_attn._module.dense_bias
    mid, start, out = (saved[(last, name)] for name in ("layer_mid", "layer_input", "attention_output"))
    assert torch.allclose(mid, start + out + bias, atol=1e-6)
    assert not torch.allclose(mid, start + out, atol=1e-2)  # the bias is not in attention_output
    premix = saved[(last, "attention_premix")]
    assert torch.equal(out, model.layers[last].self_attn._module.dense(premix))
    notes = model.support(last).notes
    assert "without the last layer's dense_bias" in notes["self_attn.attention_output"]
    assert "layer_mid" not in model.support(0).notes


def test_japanese_values_and_their_meanings():
    model = tiny("gpt_neox_japanese")
    saved = saved_for("gpt_neox_japanese")
    attn = model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale) == (4, 4, 16, 0.25)
    # the values are the fused projection's third slice of each head; queries and keys rotate only their first 4 dims
    qkv = model.layers[0].self_attn._module.query_key_value(saved[(0, "attention_norm_output")])
    split = attnlens.split_fused_qkv(model, qkv, 0)
    assert torch.equal(saved[(0, "attention_values")], split["v"].transpose(1, 2))
    assert torch.equal(saved[(0, "attention_queries")][..., 4:], split["q"].transpose(1, 2)[..., 4:])
    assert not torch.allclose(saved[(0, "attention_queries")][..., 1:4, :4], split["q"].transpose(1, 2)[..., 1:4, :4])
    # the pattern is formed whatever attn_implementation says: nothing is eager-only
    assert model.family.eager.only == ()
    assert model.support(0)["self_attn.attention_probabilities"] is None


def test_japanese_edits_land():
    model = tiny("gpt_neox_japanese")
    attn = model.layers[1].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        attn.attention_probabilities[:] = 0  # in place, on the tensor the values are mixed with
        heads = attn.attention_head_outputs.save()
        out = attn.attention_output.save()
    assert (heads == 0).all() and (out == 0).all()  # no bias in the middle layer's dense
