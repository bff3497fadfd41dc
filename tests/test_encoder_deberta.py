"""DeBERTa and DeBERTa-v2 as encoders (`families/deberta.py`): every layout against transformers' own patterns, hidden
states and logits; the disentangled relative terms (`attention_position_bias`) recomputed entry by entry; an edit of
them moving the scores and the logits as recomputing by hand predicts; DeBERTa's mask of padded queries' rows; and
what is not served (talking heads, DeBERTa-v2's convolution) saying so."""

import math

import pytest
import torch
from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.families.deberta import bucket

PROMPT = "Hello world, and again"  # 22 positions: beyond DeBERTa-v2's 8 buckets' exact half and short_span's 3


def encoder(case: str, **config) -> attnlens.StandardizedEncoder:
    inner = attnlens.models.tiny_model(case, **config)
    return attnlens.StandardizedEncoder(inner, tokenizer=attnlens.models.char_tokenizer())


def ids(model, prompt=PROMPT):
    return model.tokenizer(prompt, return_tensors="pt").input_ids


CASES = [
    "deberta",
    "deberta:absolute",
    "deberta:c2p",
    "deberta:short_span",
    "deberta-v2",
    "deberta-v2:absolute",
    "deberta-v2:own_projections",
    "deberta-v2:unbucketed",
    "deberta-v2:p2c",
]


@pytest.mark.parametrize("case", CASES)
def test_every_layout_holds_its_identities_and_equals_transformers(case):
    model = encoder(case)
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[]] * model.num_layers
    with torch.no_grad():
        reference = model._module(ids(model), output_attentions=True, output_hidden_states=True)
    for layer in range(model.num_layers):
        assert torch.equal(saved[(layer, "attention_probabilities")], reference.attentions[layer])
        assert torch.equal(saved[(layer, "layer_output")], reference.hidden_states[layer + 1])
    assert torch.equal(saved["logits"], reference.logits)
    bias = model.support(0)["self_attn.attention_position_bias"]
    if case.endswith(":absolute"):  # the config classes' defaults: no relative attention
        assert bias is not None and "relative_attention=False" in bias
    else:
        assert bias is None
        assert saved[(1, "attention_position_bias")].shape == (1, 4, len(PROMPT), len(PROMPT))


def _by_hand(model, saved, layer, i, j, head):
    """One entry of `layer`'s relative terms from the definitions, in plain Python indexing: the row of the relative
    embeddings the distance i - j reads (clamped; bucketed on DeBERTa-v2), each term's projection of it, one dot product
    with the query's or the key's content, the scale."""
    inner, config = model._module, model.config
    attention = inner.deberta.encoder.layer[layer].attention.self
    q = saved[(layer, "attention_queries")][0, head, i]
    k = saved[(layer, "attention_keys")][0, head, j]
    d = q.shape[-1]
    terms = config.pos_att_type
    scale = math.sqrt(d * (1 + len(terms)))
    heads = slice(head * d, (head + 1) * d)
    if config.model_type == "deberta":
        largest = attention.max_relative_positions
        span = min(len(PROMPT), largest)
        row = largest - span + min(max(i - j + span, 0), 2 * span - 1)
        embedding = inner.deberta.encoder.rel_embeddings.weight[row]
        c2p = q @ attention.pos_proj(embedding)[heads] / scale
        p2c = k @ attention.pos_q_proj(embedding)[heads] / scale
    else:
        span, mid, largest = config.position_buckets, config.position_buckets // 2, config.max_position_embeddings
        distance = i - j
        if abs(distance) > mid:
            distance = int(
                math.copysign(
                    mid + math.ceil(math.log(abs(distance) / mid) / math.log((largest - 1) / mid) * (mid - 1)), distance
                )
            )
        encoder = inner.deberta.encoder
        embedding = encoder.LayerNorm(encoder.rel_embeddings.weight)[min(max(distance + span, 0), 2 * span - 1)]
        c2p = q @ attention.key_proj(embedding)[heads] / scale
        p2c = k @ attention.query_proj(embedding)[heads] / scale
    return {"c2p": c2p, "p2c": p2c}


@pytest.mark.parametrize("case", ["deberta:short_span", "deberta-v2"])
def test_the_position_bias_is_c2p_plus_p2c_entry_by_entry(case):
    """Near and far pairs, both directions: DeBERTa with distances clamped at 3, DeBERTa-v2 in logarithmic buckets
    beyond 4 (of 8), its relative embeddings normalised and projected by the content projections (v3's arrangement)."""
    model = encoder(case)
    saved = read_everything(model, PROMPT, layers=[1])
    bias = saved[(1, "attention_position_bias")]
    for i, j, head in [(0, 0, 0), (3, 5, 1), (5, 3, 2), (0, 21, 3), (21, 0, 0), (17, 9, 1), (2, 14, 2)]:
        terms = _by_hand(model, saved, 1, i, j, head)
        assert torch.allclose(bias[0, head, i, j], terms["c2p"] + terms["p2c"], atol=1e-5), (i, j, head)
        assert not torch.allclose(bias[0, head, i, j], terms["c2p"], atol=1e-4), "both terms count"


def test_the_buckets_are_transformers_own():
    distances = torch.arange(-600, 601)
    for buckets, largest in [(8, 128), (256, 512), (6, 20)]:
        expected = make_log_bucket_position(distances, buckets, largest).long()
        assert torch.equal(bucket(distances, buckets, largest), expected)


def _hooked_logits(model, layer, delta):
    """transformers' own forward with `layer`'s relative terms plus `delta` ([batch, heads, q, k]): the method that
    computes them wrapped on that one attention module."""
    attention = model._module.deberta.encoder.layer[layer].attention.self
    name = "disentangled_att_bias" if hasattr(attention, "in_proj") else "disentangled_attention_bias"
    original = getattr(attention, name)

    def shifted(*args, **kwargs):
        terms = original(*args, **kwargs)
        return terms + delta.reshape(terms.shape)  # DeBERTa-v2's are [batch * heads, q, k]

    setattr(attention, name, shifted)
    try:
        with torch.no_grad():
            return model._module(ids(model)).logits
    finally:
        delattr(attention, name)


@pytest.mark.parametrize("case", ["deberta", "deberta-v2"])
def test_an_edit_of_the_position_bias_moves_scores_and_logits_as_recomputed_by_hand(case):
    model = encoder(case)
    with torch.no_grad(), model.trace(PROMPT):
        attention = model.layers[1].self_attn
        bias = attention.attention_position_bias.save()
        scores = attention.attention_scores.save()
        plain = model.logits.save()
    torch.manual_seed(1)
    delta = torch.zeros_like(bias)
    delta[:, 2] = torch.randn_like(bias[:, 2]) * 3  # head 2 only
    with torch.no_grad(), model.trace(PROMPT):
        attention = model.layers[1].self_attn
        before = model.layers[0].self_attn.attention_scores.save()
        attention.attention_position_bias = attention.attention_position_bias + delta
        edited_scores = attention.attention_scores.save()
        edited_pattern = attention.attention_probabilities.save()
        logits = model.logits.save()
    assert torch.allclose(edited_scores, scores + delta, atol=1e-5)  # the scores add the term, nothing else moves
    assert torch.equal(edited_scores[:, [0, 1, 3]], scores[:, [0, 1, 3]])
    assert torch.allclose(edited_pattern, (scores + delta).softmax(-1), atol=1e-6)
    assert torch.allclose(logits, _hooked_logits(model, 1, delta), atol=1e-5)
    assert not torch.allclose(logits, plain, atol=1e-3)
    saved = read_everything(model, PROMPT, layers=[0])
    assert torch.equal(before, saved[(0, "attention_scores")]), "the layer before is untouched"


@pytest.mark.parametrize("case", ["deberta", "deberta-v2"])
def test_padding_masks_padded_keys_and_padded_queries_rows_as_the_score_function_says(case):
    model = encoder(case)
    prompts = ["Hello world", "Hi"]
    batch = model.tokenizer(prompts, return_tensors="pt", padding=True)
    saved = read_everything(model, prompts, layers=[1])  # in the forward's order (DeBERTa's keys come first)
    queries, keys, bias = (saved[(1, f"attention_{name}")] for name in ("queries", "keys", "position_bias"))
    scores, pattern = saved[(1, "attention_scores")], saved[(1, "attention_probabilities")]
    with torch.no_grad():
        reference = model._module(**batch, output_attentions=True).attentions[1]
    assert torch.equal(pattern, reference)  # padded rows included: DeBERTa's own masking, whole
    score_function = model.family.score_function()
    rebuilt = (
        score_function.scores(model.layers[1].self_attn.heads, model.config, queries, keys, 1, batch.attention_mask)
        + bias
    )
    assert torch.allclose(rebuilt, scores, atol=1e-5)
    padded = ~batch.attention_mask.bool()[1]
    assert (scores[1][:, padded] == torch.finfo(scores.dtype).min).all(), "a padded query's whole row"
    assert torch.allclose(pattern[1][:, padded], torch.full_like(pattern[1][:, padded], 1 / padded.numel()))
    assert (pattern[1][:, ~padded][..., padded] == 0).all()


def test_what_is_not_served_says_why():
    talking = encoder("deberta", talking_head=True).support(0)
    assert talking["self_attn.attention_scores"].startswith("with talking_head")
    assert talking["self_attn.attention_probabilities"].startswith("with talking_head")
    absolute = encoder("deberta-v2:absolute").support(0)
    assert "relative_attention=False" in absolute["self_attn.attention_position_bias"]


def test_deberta_v2s_convolution_leaves_the_first_blocks_output_unserved_and_the_rest_exact():
    model = encoder("deberta-v2", conv_kernel_size=3)
    assert model.support(0)["layer_output"].startswith("DeBERTa-v2's encoder passes layers[0]'s output")
    assert model.support(1)["layer_output"] is None
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[]] * model.num_layers
    with torch.no_grad(), model.trace(PROMPT):
        block = model.layers[0].output[0].save()  # the first block's own output, before the convolution
    with torch.no_grad():
        reference = model._module(ids(model), output_hidden_states=True)
    assert torch.equal(saved[(1, "layer_input")], reference.hidden_states[1]), "the stream after the convolution"
    assert not torch.allclose(block, reference.hidden_states[1], atol=1e-2), "which is not the block's output"
    assert torch.equal(saved["logits"], reference.logits)
