"""Direct attribution on encoders (`StandardizedEncoder`) and encoder-decoders (`StandardizedSeq2Seq`): where it is
served the pieces add up to the run's own value and a by-source piece equals its computation by hand on the same
weights; where it is not (post-norm stacks, a prediction head with an activation after the final norm) it is refused
with the reason `support().analyses` gives.

Tolerance: float32 sums of a few hundred terms, 1e-4 relative to the value's size (`close`); a single piece by hand,
1e-5 absolute plus 1e-4 relative."""

import warnings

import pytest
import torch
import transformers
from test_seq2seq import AUDIO

import attnlens
from attnlens.analysis import attribution, unavailable
from attnlens.analysis.reasons import direction_reason, model_reason, split_reason

PROMPT = "Hello world"
#: The encoders this transformers has the config class of (a type newer than it is left out).
ENCODERS = [case for case in attnlens.models.tiny_cases(causal=False) if attnlens.models._causal(case) is not None]
SEQ2SEQ = attnlens.models.tiny_seq2seq_cases()
SOURCE = torch.tensor([5, 6, 7, 8, 9, 10])
TARGET = torch.tensor([2, 11, 12, 13])
_models: dict = {}


def close(a, b):
    return float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))


def tiny(case):
    if case not in _models:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _models[case] = attnlens.models.tiny(case)
    return _models[case]


def tiny_seq2seq(model_type):
    key = ("seq2seq", model_type)
    if key not in _models:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = attnlens.models.tiny_seq2seq(model_type)
            bias = getattr(model._module, "final_logits_bias", None)
            if bias is not None:  # BART's buffer after lm_head starts at zero: moved off it, so reading it counts
                bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(2)))
            _models[key] = model
    return _models[key]


def source(model_type):
    if model_type in AUDIO:  # a speech model's audio, by the keyword it takes
        name, shape = AUDIO[model_type]
        return {name: torch.randn(1, *shape, generator=torch.Generator().manual_seed(1))}
    return SOURCE


def direction(hidden):
    return torch.randn(hidden, generator=torch.Generator().manual_seed(0))


# --- encoders -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ENCODERS)
def test_encoder_pieces_add_up_or_the_refusal_names_why(case):
    model = tiny(case)
    hidden = model.config.hidden_size
    whole, partial = model_reason(model), direction_reason(model)
    for layer in range(model.num_layers):
        assert unavailable(model, layer).get("attribution", "x") == (whole or "x") or whole is None
    if partial is not None:  # nothing decomposed: the stream is no sum (post-norm), or no final norm
        for kwargs in ({"target": "a"}, {"direction": direction(hidden)}):
            with pytest.raises(attnlens.Unavailable, match="attribution") as refused:
                attribution(model, PROMPT, **kwargs)
            assert partial in str(refused.value)
        return
    with torch.no_grad(), model.trace(PROMPT):
        final = model.final_norm_output.save()
        logits = model.logits.save()
    found = attribution(model, PROMPT, rows=[3, 0], direction=direction(hidden))
    assert close(found.value, final[0, [3, 0]] @ direction(hidden))
    assert close(found.total, found.value)
    for layer in found.heads:
        assert close(found.split_total(layer), found.attention[layer]), layer
    if whole is None:  # a plain unembedding after the final norm: the token's logit itself
        found = attribution(model, PROMPT, rows=[3, 0], target="a", versus="b")
        a, b = (model.tokenizer(t, add_special_tokens=False).input_ids[0] for t in "ab")
        assert close(found.total, logits[0, [3, 0], a] - logits[0, [3, 0], b])
    else:  # a prediction head with an activation between the final norm and the unembedding
        with pytest.raises(attnlens.Unavailable, match="direction=") as refused:
            attribution(model, PROMPT, target="a")
        assert whole in str(refused.value)


def test_which_encoders_are_served():
    """What the tiny encoders get, named: the pre-norm ones split, the post-norm ones refused as such."""
    served = {case for case in ENCODERS if direction_reason(tiny(case)) is None}
    logits = {case for case in ENCODERS if model_reason(tiny(case)) is None}
    assert served == {"esm", "esm:rotary", "esmc", "eurobert", "modernbert", "neomme", "ultrabert"} & set(ENCODERS)
    assert logits == {"eurobert"} & set(ENCODERS)
    for case in ("convbert", "deberta", "distilbert", "gte", "layoutlm", "mpnet", "nomic_bert", "tapas"):
        assert "post-norm" in direction_reason(tiny(case)), case
    assert "premix" in split_reason(tiny("neomme"), 0)  # exclusive self-attention: not split by head


def by_hand_piece(model, layer, row, head, key, weight, u):
    """pattern[row, key] * (values[key] @ W_O[:, head slice].T) . u, from the run's pattern and values."""
    with torch.no_grad(), model.trace(PROMPT):
        attention = model.layers[layer].self_attn
        values = attention.attention_values.save()
        pattern = attention.attention_probabilities.save()
    size = values.shape[-1]
    groups = pattern.shape[1] // values.shape[1]
    value = values[0, head // groups, key]
    return pattern[0, head, row, key] * (value @ weight[:, head * size : (head + 1) * size].T) @ u


@pytest.mark.parametrize(
    ("case", "projection"),
    [("esm", "attention.output.dense"), ("eurobert", "self_attn.o_proj"), ("modernbert", "attn.Wo")],
)
def test_an_encoder_piece_equals_its_computation_by_hand(case, projection):
    """ESM's output projection nests in `attention.output` (its family's own project_output): read, it is split."""
    model = tiny(case)
    hidden = model.config.hidden_size
    d = direction(hidden)
    row, layer = 2, 1
    found = attribution(model, PROMPT, rows=[row], direction=d)
    with torch.no_grad(), model.trace(PROMPT):
        residual = model.layers[-1].layer_output.save()
    norm = model._module.get_submodule(model.family.final_norm)
    x = residual[0, row]
    centred = isinstance(norm, torch.nn.LayerNorm) or "LayerNorm" in type(norm).__name__
    if centred:
        scale = ((x - x.mean()).pow(2).mean() + norm.eps).sqrt()
        u = d * norm.weight
        u = u - u.mean()
    else:
        scale = (x.pow(2).mean() + norm.variance_epsilon).sqrt()  # EuroBERT's RMSNorm
        u = d * norm.weight
    weight = model.layers[layer]._module.get_submodule(projection).weight
    for head, key in ((0, 0), (1, row), (3, 7)):  # key 7 > row: a bidirectional encoder reads later keys
        expected = (by_hand_piece(model, layer, row, head, key, weight, u) / scale).detach()
        piece = found.heads[layer][0, head, key]
        assert abs(float(piece - expected)) <= 1e-5 + 1e-4 * abs(float(expected)), (head, key)
    assert bool((found.heads[layer][0, :, row + 1 :] != 0).any())


def test_a_classifier_logit_is_refused_and_its_input_direction_is_split():
    """A classifier's head (ModernBERT's dense, GELU, norm; pooling) is not linear: the class logit is refused, the
    direction it reads of the [CLS] row's final_norm_output is decomposed exactly."""
    config = attnlens.models.tiny_model("modernbert").config
    torch.manual_seed(0)
    classifier = transformers.ModernBertForSequenceClassification(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = attnlens.StandardizedEncoder(classifier, tokenizer=attnlens.models.char_tokenizer())
    with pytest.raises(attnlens.Unavailable, match="attribution"):
        attribution(model, PROMPT, rows=0, target=1)
    d = direction(config.hidden_size)
    with torch.no_grad(), model.trace(PROMPT):
        final = model.final_norm_output.save()
    found = attribution(model, PROMPT, rows=0, direction=d)
    assert close(found.total, final[0, [0]] @ d)
    assert sorted(found.heads) == list(range(model.num_layers))


# --- encoder-decoders -----------------------------------------------------------------------------------------------


def encoder_length(model, model_type):
    """How many positions the encoder's output has (Whisper's: its frames after the convolutions, padded as the
    model pads them), from transformers' own run."""
    inputs = source(model_type)
    inputs = inputs if isinstance(inputs, dict) else {"input_ids": inputs[None]}
    with torch.no_grad():
        return model._module(**inputs, decoder_input_ids=TARGET[None]).encoder_last_hidden_state.shape[1]


def run_logits(model, model_type):
    """The run's logits, before the final soft-cap where the decoder caps them (T5Gemma): what attribution splits."""
    inputs = source(model_type)
    inputs = inputs if isinstance(inputs, dict) else {"input_ids": inputs[None]}
    with torch.no_grad(), model.trace(**inputs, decoder_input_ids=TARGET[None]):
        logits = model.logits.save()
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    return logits[0] if cap is None else cap * torch.atanh(logits[0] / cap)


@pytest.mark.parametrize("model_type", SEQ2SEQ)
def test_a_decoder_logit_adds_up_through_self_and_cross_attention(model_type):
    model = tiny_seq2seq(model_type)
    said = model.support(0).analyses["attribution"]
    post_norm = (
        "bart",
        "plbart",
        "marian",
        "blenderbot-small",
        "speecht5",
        "mvp",
        "fsmt",
        "led",
        "encoder-decoder",
        "encoder-decoder:roberta",
    )
    if model_type in post_norm:  # post-norm decoders (BART's, MVP's, FSMT's, LED's, SpeechT5's, BERT's and RoBERTa's)
        assert "post-norm" in said
        with pytest.raises(attnlens.Unavailable, match="post-norm"):
            attribution(model, source(model_type), target=5, decoder_input_ids=TARGET)
        return
    assert said is None
    found = attribution(model, source(model_type), rows=[-1, 1], target=5, versus=7, decoder_input_ids=TARGET)
    logits = run_logits(model, model_type)
    expected = logits[[3, 1], 5] - logits[[3, 1], 7]
    assert close(found.value, expected)
    assert close(found.total, expected)
    assert sorted(found.heads) == sorted(found.cross_heads) == [0, 1]
    length = encoder_length(model, model_type)
    for layer in (0, 1):
        assert found.heads[layer].shape == (2, 4, len(TARGET))
        assert found.cross_heads[layer].shape == (2, 4, length)
        assert close(found.split_total(layer), found.attention[layer])
        assert close(found.cross_split_total(layer), found.cross_attention[layer])
    assert len(found.sources) == length
    assert abs(sum(term["value"] for term in found.terms()) - float(found.value[0])) < 1e-4


@pytest.mark.parametrize(
    ("model_type", "projection"), [("mbart", "encoder_attn.out_proj"), ("t5", "layer.1.EncDecAttention.o")]
)
def test_a_cross_piece_equals_its_computation_by_hand(model_type, projection):
    """By encoder position: pattern[row, s] * (cross values[s] @ W_O slice) . u, u the logit difference's read-out
    pulled back through the decoder's frozen final norm (times T5's d_model ** -0.5 where its head is tied)."""
    model = tiny_seq2seq(model_type)
    row, layer = 2, 1
    found = attribution(model, SOURCE, rows=[row], target=5, versus=7, decoder_input_ids=TARGET)
    with torch.no_grad(), model.trace(input_ids=SOURCE[None], decoder_input_ids=TARGET[None]):
        cross = model.decoder.layers[layer].cross_attn
        values, pattern = cross.attention_values.save(), cross.attention_probabilities.save()
        outputs = cross.attention_output.save()
        residual = model.decoder.layers[-1].layer_output.save()
    root = model._module
    norm = model.decoder._module.get_submodule(model.decoder.family.final_norm)
    unembedding = root.get_output_embeddings().weight
    d = unembedding[5] - unembedding[7]
    x = residual[0, row]
    if model_type == "t5":  # RMSNorm, and the tied head's rescaling of the decoder output
        scale, u = (x.pow(2).mean() + norm.variance_epsilon).sqrt(), d * norm.weight * model.config.d_model**-0.5
    else:
        scale, u = ((x - x.mean()).pow(2).mean() + norm.eps).sqrt(), d * norm.weight
        u = u - u.mean()
    weight = model.decoder.layers[layer]._module.get_submodule(projection).weight
    size = values.shape[-1]
    for head in range(4):
        slice_ = weight[:, head * size : (head + 1) * size]
        by_source = pattern[0, head, row, :, None] * (values[0, head] @ slice_.T)  # [source, hidden]
        expected = (by_source @ u / scale).detach()
        assert torch.allclose(found.cross_heads[layer][0, head], expected, atol=1e-5, rtol=1e-4), head
    # the heads' pieces over every encoder position, and the bias, are the cross-attention's output read out
    bias = getattr(model.decoder.layers[layer]._module.get_submodule(projection), "bias", None)
    whole = ((outputs[0, row] - (0 if bias is None else bias)) @ u / scale).detach()
    assert abs(float(found.by_cross_head()[layer][0].sum() - whole)) <= 1e-5 + 1e-4 * abs(float(whole))


def test_a_wrong_source_breaks_the_hand_check():
    """The by-hand check can fail: the pieces of one encoder position against another's differ."""
    model = tiny_seq2seq("mbart")
    found = attribution(model, SOURCE, rows=[2], target=5, decoder_input_ids=TARGET)
    pieces = found.cross_heads[1][0]
    assert not torch.allclose(pieces[:, 0], pieces[:, 1], atol=1e-5)


def test_whisper_sources_are_encoder_positions_and_the_arguments_are_checked():
    model = tiny_seq2seq("whisper")
    found = attribution(model, source("whisper"), direction=direction(64), decoder_input_ids=TARGET)
    assert found.sources == [f"@{i}" for i in range(encoder_length(model, "whisper"))]
    with pytest.raises(ValueError, match="decoder_input_ids"):
        attribution(model, source("whisper"), target=5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        attribution(model, source("whisper"), target=5, decoder_input_ids=TARGET, max_new_tokens=2)
    with pytest.raises(ValueError, match="encoder-decoder"):
        attribution(tiny("eurobert"), PROMPT, target="a", decoder_input_ids=TARGET)
