"""`EncoderDecoderModel`: its family composed from its two models' families (attnlens/families/encoder_decoder.py).
An edit of the cross-attention the composition adds lands as a hook on plain transformers predicts; a composition
without the cross-attention's own arithmetic fails the identities; each stack reads its own config; the pairs and
types attnlens does not serve are refused with their reasons."""

import warnings

import pytest
import torch
import transformers

import attnlens
from attnlens.checks import failures, read_stacks
from attnlens.families.bert import Bert
from attnlens.families.encoder_decoder import BertCrossAttention, CrossAttending, EncoderDecoderModels, tiny_pair
from attnlens.families.gpt2 import GPT2
from attnlens.stacks import refusal

SOURCE = torch.tensor([[5, 6, 7, 8, 9, 10]])
TARGET = torch.tensor([[2, 11, 12, 13]])


def tiny(case: str) -> attnlens.StandardizedSeq2Seq:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attnlens.models.tiny_seq2seq(case)


def ablated_logits(model, head: int):
    with torch.no_grad(), model.trace(SOURCE, decoder_input_ids=TARGET):
        model.decoder.layers[1].cross_attn.attention_head_outputs[:, :, head] = 0
        logits = model.logits.save()
    return logits


def by_hook(module: torch.nn.Module, inner: torch.nn.Module, head: int) -> torch.Tensor:
    """The logits with `head`'s slice of what `module` receives (the merged heads) zeroed, on plain transformers."""

    def zero_head(_, args):
        merged = args[0].clone()
        merged.view(*merged.shape[:2], 4, 16)[:, :, head] = 0
        return (merged, *args[1:])

    handle = module.register_forward_pre_hook(zero_head)
    try:
        with torch.no_grad():
            return inner(SOURCE, decoder_input_ids=TARGET).logits
    finally:
        handle.remove()


@pytest.mark.parametrize(
    ("case", "projection"),
    [
        ("encoder-decoder:bert-gpt2", "transformer.h.1.crossattention.c_proj"),
        ("encoder-decoder", "bert.encoder.layer.1.crossattention.output.dense"),
    ],
)
def test_a_cross_attention_head_ablated_moves_the_logits_as_a_hook_on_transformers_predicts(case, projection):
    """Zeroing head 2 of the last decoder block's cross-attention (GPT-2's `crossattention`, BERT's) equals zeroing its
    slice of what the cross-attention's output projection receives, by a hook on plain transformers."""
    model = tiny(case)
    inner = model._module
    logits = ablated_logits(model, 2)
    expected = by_hook(inner.decoder.get_submodule(projection), inner, 2)
    with torch.no_grad():
        plain = inner(SOURCE, decoder_input_ids=TARGET).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert float((logits - plain).abs().max()) > 1e-3, "the ablation moved the logits"


def test_each_stack_reads_its_own_config_and_family():
    """The BERT encoder reads `config.encoder` (bidirectional, no KV cache, no logits), the GPT-2 decoder
    `config.decoder` (causal, its cross-attention behind ln_cross_attn)."""
    model = tiny("encoder-decoder:bert-gpt2")
    assert model.family.name == "EncoderDecoder(BertEncoder, GPT2Decoder)"
    assert model.encoder.config is model.config.encoder and model.decoder.config is model.config.decoder
    encoder, decoder = model.encoder.support(0), model.decoder.support(0)
    assert encoder.notes["self_attn.attention_probabilities"].startswith("bidirectional")
    assert encoder["self_attn.attention_cache_keys"].startswith("an encoder keeps no KV cache")
    assert "cross_attn.attention_probabilities" not in encoder.reasons
    assert encoder["logits"].startswith("the encoder is its type's base model, without a head")
    assert decoder["cross_attn.attention_probabilities"] is None and decoder["cross_attention_norm_output"] is None
    assert decoder["self_attn.attention_cache_visible"] is None  # GPT-2's block passes attention_mask by keyword
    assert model.decoder.family.cross_attention_norm == "ln_cross_attn"


def test_the_identities_catch_a_bert_decoder_composed_without_its_cross_attentions_arithmetic():
    """BERT's decoder family with the cross-attention's locations but BERT's own residual arithmetic (no norm between
    the self-attention and the cross-attention, the MLP's stream from the self-attention's norm) fails the identities:
    they check what the composition adds."""

    class Unnormed(CrossAttending):  # BertCrossAttention's locations, not its Identities
        mlp_norm = BertCrossAttention.mlp_norm
        attention_function_module = BertCrossAttention.attention_function_module

    inner = attnlens.models.tiny_seq2seq_model("encoder-decoder")
    composed = EncoderDecoderModels().composed(inner.config)
    miswired = type("Miswired", (type(composed),), {"decoder": type("Decoder", (Unnormed, Bert), {})})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = {}
        for family in (composed, miswired):
            model = attnlens.StandardizedSeq2Seq(inner, tokenizer=attnlens.models.char_tokenizer(), family=family)
            saved = read_stacks(model, SOURCE, decoder_input_ids=TARGET)
            found[family is composed] = failures(model.decoder, saved["decoder"], 0)
    assert found[True] == []
    assert "layer input + attention output == cross attention input" in found[False], found[False]


def pair(encoder: dict, decoder: dict) -> transformers.EncoderDecoderConfig:
    # copies: transformers 5.19's EncoderDecoderConfig pops each dict's model_type
    return transformers.EncoderDecoderConfig(encoder=dict(encoder), decoder=dict(decoder))


def test_pairs_whose_families_are_unknown_are_refused_with_the_reason():
    bert, gpt2 = tiny_pair(Bert, GPT2)["encoder"], tiny_pair(Bert, GPT2)["decoder"]
    opt = {"model_type": "opt", "is_decoder": True, "add_cross_attention": True}
    said = refusal(pair(bert, opt))
    assert "not of 'opt' ones" in said and "bert, roberta, gpt2 decoders" in said
    assert "is_decoder and add_cross_attention" in refusal(pair(bert, {**gpt2, "add_cross_attention": False}))
    assert "not 'gpt2'" in refusal(pair({**gpt2, "is_decoder": False, "add_cross_attention": False}, gpt2))
    assert refusal(pair(bert, gpt2)) is None


@pytest.mark.parametrize(
    ("model_type", "words"), [("speech-encoder-decoder", "speech encoder"), ("prophetnet", "n-gram")]
)
def test_speech_encoder_decoders_and_prophetnet_are_refused_with_the_reason(model_type, words):
    config = type("Config", (), {"model_type": model_type, "is_encoder_decoder": True})()
    said = refusal(config)
    assert said.startswith(f"attnlens has no encoder-decoder family for model type {model_type!r}") and words in said


@pytest.mark.parametrize("case", ["encoder-decoder", "encoder-decoder:bert-gpt2"])
def test_source_padding_is_masked_in_the_cross_attention_as_transformers_masks_it(case):
    """A padded source: the decoder's cross-attention (BERT's, GPT-2's) never reads the padding, equal to transformers'
    own pattern, and the score function's cross scores with the source's mask are the scores read."""
    model = tiny(case)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 0, 0, 0]])
    mask, target = (ids != 0).long(), TARGET.expand(2, -1)
    with torch.no_grad(), model.trace(input_ids=ids, attention_mask=mask, decoder_input_ids=target):
        cross = model.decoder.layers[1].cross_attn
        queries, keys = cross.attention_queries.save(), cross.attention_keys.save()
        scores, pattern = cross.attention_scores.save(), cross.attention_probabilities.save()
    with torch.no_grad():
        reference = model._module(input_ids=ids, attention_mask=mask, decoder_input_ids=target, output_attentions=True)
    assert torch.equal(pattern, reference.cross_attentions[1])
    assert (pattern[1, :, :, 3:] == 0).all() and (pattern[1, :, :, :3] > 0).all()
    heads = model.decoder.layers[1].cross_attn.heads
    rebuilt = model.decoder.family.score_function().cross_scores(heads, model.decoder.config, queries, keys, 1, mask)
    torch.testing.assert_close(rebuilt[1, :, :, :3], scores[1, :, :, :3])
    assert (scores[1, :, :, 3:] < -1e30).all()
