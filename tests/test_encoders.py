"""BERT as an encoder: bidirectional attention (the family's score function says so from the config), with padding,
under every head transformers gives it, against transformers' own attention (`output_attentions`). The causal
`BertLMHeadModel` (`is_decoder=True`) is the family's tiny model and runs every family test; this file holds what
only the encoder does."""

import pytest
import torch
import transformers

import attnlens
from attnlens import verification
from attnlens.checks import failures, read_everything

SIZES = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128)
HEADS = ("BertForMaskedLM", "BertModel", "BertForSequenceClassification", "BertForTokenClassification")
PROMPT = "Hello world"


def encoder(head: str, **config) -> attnlens.StandardizedTransformer:
    torch.manual_seed(0)
    inner = getattr(transformers, head)(transformers.BertConfig(**SIZES, attn_implementation="eager", **config))
    return attnlens.StandardizedTransformer(inner.eval(), tokenizer=attnlens.models.char_tokenizer())


@pytest.mark.parametrize("head", HEADS)
def test_every_head_serves_bidirectional_attention_equal_to_transformers(head):
    model = encoder(head)
    assert not model.family.score_function().causal(model.config)
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[], []]
    verification.verify(model)  # the load-time verification finds nothing wrong either
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = model._module(ids, output_attentions=True, output_hidden_states=True)
    for layer in range(model.num_layers):
        pattern = saved[(layer, "attention_probabilities")]
        assert torch.equal(pattern, reference.attentions[layer])
        assert (pattern[..., 1:, :1] > 0).all(), "an earlier key is seen by every later query, and the reverse:"
        assert (pattern[..., :1, 1:] > 0).all()
        assert torch.equal(saved[(layer, "layer_output")], reference.hidden_states[layer + 1])
    if head == "BertModel":  # no head: the prefix `bert.` of the family's paths dropped, and no logits
        assert model.family.layers == "encoder.layer"
        assert model.support()["logits"].startswith("BertModel is a base model without a head")
    else:
        assert torch.equal(saved["logits"], reference.logits)


def test_padding_is_masked_in_every_row_and_the_score_function_reproduces_it():
    model = encoder("BertForMaskedLM")
    prompts = ["Hello world", "Hi"]
    batch = model.tokenizer(prompts, return_tensors="pt", padding=True)
    keys = batch.attention_mask.bool()
    with torch.no_grad(), model.trace(prompts):
        attention = model.layers[1].self_attn
        queries, keys_read = attention.attention_queries.save(), attention.attention_keys.save()
        scores, pattern = attention.attention_scores.save(), attention.attention_probabilities.save()
    with torch.no_grad():
        reference = model._module(**batch, output_attentions=True).attentions[1]
    real = keys[:, None, :, None] & keys[:, None, None, :]  # rows and columns of real tokens
    assert torch.allclose(pattern[real.expand_as(pattern)], reference[real.expand_as(pattern)], atol=1e-6)
    assert (pattern.masked_select(~keys[:, None, None, :].expand_as(pattern)) == 0).all()
    heads = model.layers[1].self_attn.heads
    rebuilt = model.family.score_function().scores(heads, model.config, queries, keys_read, 1, batch.attention_mask)
    assert torch.allclose(rebuilt, scores)


def test_a_head_ablated_moves_the_masked_lm_logits_as_recomputed_by_hand():
    """Zeroing head 2's output in layer 0 equals zeroing its slice of what `attention.self` returns, by a hook."""
    model = encoder("BertForMaskedLM")
    with torch.no_grad(), model.trace(PROMPT):
        heads = model.layers[0].self_attn.attention_head_outputs
        heads[:, :, 2] = 0
        logits = model.logits.save()

    def zero_head(module, args, output):
        merged, weights = output
        merged = merged.clone()
        merged.view(*merged.shape[:2], 4, 16)[:, :, 2] = 0
        return merged, weights

    inner = model._module
    handle = inner.bert.encoder.layer[0].attention.self.register_forward_hook(zero_head)
    try:
        with torch.no_grad():
            expected = inner(model.tokenizer(PROMPT, return_tensors="pt").input_ids).logits
    finally:
        handle.remove()
    assert torch.allclose(logits, expected, atol=1e-5)
    with torch.no_grad():
        plain = inner(model.tokenizer(PROMPT, return_tensors="pt").input_ids).logits
    assert not torch.allclose(logits, plain, atol=1e-3)


def test_support_says_what_the_encoder_is():
    report = encoder("BertForMaskedLM").support(0)
    assert report.notes["self_attn.attention_probabilities"].startswith("bidirectional")
    assert report["attention_norm_output"].startswith("BERT normalises after each residual add")
    causal = attnlens.models.tiny("bert").support(0)
    assert causal.notes["self_attn.attention_probabilities"].startswith("causal")


#: The types built as BERT is (`families/bert.py`, `bert_shaped`), by their masked-LM class where they have one.
BERT_SHAPED = {
    "roberta": "RobertaForMaskedLM",
    "xlm-roberta": "XLMRobertaForMaskedLM",
    "camembert": "CamembertForMaskedLM",
    "data2vec-text": "Data2VecTextForMaskedLM",
    "electra": "ElectraForMaskedLM",
    "ernie": "ErnieForMaskedLM",
    "roc_bert": "RoCBertForMaskedLM",
    "bert-generation": "BertGenerationEncoder",
}


@pytest.mark.parametrize("model_type", sorted(BERT_SHAPED))
def test_every_bert_shaped_type_is_an_encoder_equal_to_transformers(model_type):
    """As the encoder each is (`StandardizedEncoder`, bidirectional, padded batch), every value's identities hold and
    each pattern is transformers' own, as it is for their causal LMs in every family test."""
    config = transformers.AutoConfig.for_model(model_type, **SIZES, pad_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    inner = getattr(transformers, BERT_SHAPED[model_type])(config).eval()
    model = attnlens.StandardizedEncoder(inner, tokenizer=attnlens.models.char_tokenizer())
    assert model.family.model_types == (model_type,)
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[], []]
    prompts = ["Hello world", "Hi"]
    batch = model.tokenizer(prompts, return_tensors="pt", padding=True)
    patterns = []  # (a name bound in a trace body does not outlive it; a list from outside does)
    with torch.no_grad(), model.trace(prompts):
        for layer in range(2):
            patterns.append(model.layers[layer].self_attn.attention_probabilities.save())
    with torch.no_grad():
        reference = inner(**batch, output_attentions=True).attentions
    keys = batch.attention_mask.bool()
    real = keys[:, None, :, None] & keys[:, None, None, :]
    for pattern, expected in zip(patterns, reference):
        assert torch.allclose(pattern[real.expand_as(pattern)], expected[real.expand_as(pattern)], atol=1e-6)
        assert (pattern[1, :, 0, 1:2] > 0).all(), "bidirectional: the first position reads the second"
