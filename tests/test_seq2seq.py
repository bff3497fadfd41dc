"""Encoder-decoders (`StandardizedSeq2Seq`): every type attnlens serves, built tiny, against transformers' own attention
(`output_attentions`: the encoder's, the decoder's and the cross-attentions), the identities on both stacks, every
unserved value's reason, generation step by step, padding, an edit recomputed by hand, and the refusals between the
model classes."""

import warnings
from types import SimpleNamespace

import pytest
import torch
import transformers
from test_show import close, page_data

import attnlens
from attnlens.checks import failures, read_stacks
from attnlens.values import ALL_VALUES, SUBLAYER_OF

TYPES = attnlens.models.tiny_seq2seq_cases()  # each type, and each other layout of its recipe (a pair of models)
#: The types whose encoder attends in local windows, its attention's pattern refused (attnlens/families/bart_like.py).
LOCAL_ENCODERS = ("led", "pegasus_x")
SOURCE = torch.tensor([[5, 6, 7, 8, 9, 10]])
TARGET = torch.tensor([[2, 11, 12, 13]])
_models: dict = {}


def tiny(model_type: str) -> attnlens.StandardizedSeq2Seq:
    if model_type not in _models:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _models[model_type] = attnlens.models.tiny_seq2seq(model_type)
    return _models[model_type]


#: The speech types' encoder input, by model type: its name and shape past the batch (Whisper's log-mel frames, two
#: per encoder position; Speech2Text's filterbank frames, four per position; SpeechT5's waveform samples, ten each;
#: Moonshine's waveform, 384 samples per position, 320 for Moonshine Streaming; Pop2Piano's feature frames, one each).
AUDIO = {
    "whisper": ("input_features", (16, 64)),
    "speech_to_text": ("input_features", (64, 16)),
    "speecht5": ("input_values", (200,)),
    "moonshine": ("input_values", (3000,)),
    "moonshine_streaming": ("input_values", (1920,)),
    "pop2piano": ("input_features", (6, 64)),
}


def source(model_type: str, batch: int = 1) -> dict:
    """The encoder's input: token ids, or a speech type's audio (`AUDIO`)."""
    if model_type in AUDIO:
        name, shape = AUDIO[model_type]
        torch.manual_seed(1)
        return {name: torch.randn(batch, *shape)}
    return {"input_ids": SOURCE.expand(batch, -1)}


@pytest.mark.parametrize("model_type", TYPES)
def test_every_value_of_both_stacks_equals_transformers_and_the_identities_hold(model_type):
    model = tiny(model_type)
    saved = read_stacks(model, **source(model_type), decoder_input_ids=TARGET)
    for name in model.stacks:
        stack = getattr(model, name)
        assert [failures(stack, saved[name], layer) for layer in range(stack.num_layers)] == [[], []], name
    with torch.no_grad():
        reference = model._module(
            **source(model_type), decoder_input_ids=TARGET, output_attentions=True, output_hidden_states=True
        )
    encoder, decoder = saved["encoder"], saved["decoder"]
    # LED's encoder attends in Longformer's local windows: its pattern is refused with the reason (test_bart_like.py)
    local = model_type in LOCAL_ENCODERS
    assert (model.encoder.support(0)["self_attn.attention_probabilities"] is None) is not local
    for layer in range(2):
        assert torch.equal(encoder[(layer, "layer_input")], reference.encoder_hidden_states[layer])
        assert local or torch.equal(encoder[(layer, "attention_probabilities")], reference.encoder_attentions[layer])
        assert torch.equal(decoder[(layer, "attention_probabilities")], reference.decoder_attentions[layer])
        assert torch.equal(decoder[(layer, "cross_attention_probabilities")], reference.cross_attentions[layer])
        assert torch.equal(decoder[(layer, "layer_input")], reference.decoder_hidden_states[layer])
    assert torch.equal(decoder["logits"], reference.logits)
    # the bidirectional encoder: an earlier position reads a later one; the causal decoder: never
    assert local or (encoder[(0, "attention_probabilities")][..., 0, 1:] > 0).all()
    assert (decoder[(0, "attention_probabilities")][..., 0, 1:] == 0).all()
    # the cross keys are the encoder's output projected: one per source position
    length = reference.encoder_last_hidden_state.shape[1]
    assert decoder[(0, "cross_attention_keys")].shape[2] == length


@pytest.mark.parametrize("model_type", ["bart", "mbart", "t5"])
def test_every_unserved_value_raises_the_reason_support_gives(model_type):
    model = tiny(model_type)
    for name in model.stacks:
        stack = getattr(model, name)
        report = stack.support(0)
        unserved = [v for v in ALL_VALUES if v.key in report.reasons and v.scope != "model" and report[v.key]]
        assert unserved, "each stack leaves some values unserved (the KV cache values at least)"
        for value in unserved:
            said = []  # (a name bound inside a trace body does not outlive it; a list from outside does)
            with model.trace(**source(model_type), decoder_input_ids=TARGET):
                block = stack.layers[0]
                host = getattr(block, SUBLAYER_OF[value.scope]) if value.scope in SUBLAYER_OF else block
                try:
                    getattr(host, value.attribute)
                except attnlens.Unavailable as error:
                    said.append(str(error))
            assert said and said[0].endswith(report[value.key]), (name, value.key, said)
            assert said[0].startswith(f"{name}.layers[0].{value.key}")
    encoder_report = model.encoder.support(0)
    assert "cross_attn.attention_probabilities" not in encoder_report.reasons, "an encoder block has no cross_attn"
    assert model.decoder.support(0)["cross_attn.attention_probabilities"] is None


@pytest.mark.parametrize("model_type", ["bart", "t5"])
def test_generation_serves_the_cross_attention_of_every_step_as_transformers_returns_it(model_type):
    model = tiny(model_type)
    kwargs = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    patterns, keys = [], []
    with torch.no_grad(), model.generate(SOURCE, **kwargs) as tracer:
        for _ in tracer.iter[0:3]:
            cross = model.decoder.layers[1].cross_attn
            keys.append(cross.attention_keys.save())
            patterns.append(cross.attention_probabilities.save())
        tokens = tracer.result.save()
    with torch.no_grad():
        reference = model._module.generate(SOURCE, **kwargs, output_attentions=True, return_dict_in_generate=True)
    assert torch.equal(tokens, reference.sequences)
    assert [p.shape for p in patterns] == [(1, 4, 1, SOURCE.shape[1])] * 3
    for pattern, step in zip(patterns, reference.cross_attentions):
        assert torch.allclose(pattern, step[1], atol=1e-6)
    assert all(torch.equal(k, keys[0]) for k in keys), "the cross keys are computed once and cached"


def test_source_padding_is_masked_in_the_cross_attention_and_the_score_function_reproduces_it():
    model = tiny("bart")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 0, 0, 0]])
    mask = (ids != 0).long()
    target = TARGET.expand(2, -1)
    with torch.no_grad(), model.trace(input_ids=ids, attention_mask=mask, decoder_input_ids=target):
        cross = model.decoder.layers[0].cross_attn
        queries, keys = cross.attention_queries.save(), cross.attention_keys.save()
        scores, pattern = cross.attention_scores.save(), cross.attention_probabilities.save()
    with torch.no_grad():
        reference = model._module(input_ids=ids, attention_mask=mask, decoder_input_ids=target, output_attentions=True)
    assert torch.equal(pattern, reference.cross_attentions[0])
    assert (pattern[1, :, :, 3:] == 0).all() and (pattern[1, :, :, :3] > 0).all()
    score_function = model.decoder.family.score_function()
    heads = model.decoder.layers[0].cross_attn.heads
    rebuilt = score_function.cross_scores(heads, model.config, queries, keys, 0, mask)
    assert torch.allclose(rebuilt, scores)


def test_a_cross_attention_head_ablated_moves_the_logits_as_a_hook_predicts():
    """Zeroing head 1 of the last decoder block's cross-attention equals zeroing its slice of what the attention
    function returns, by a hook on `out_proj`'s input."""
    model = tiny("mbart")
    with torch.no_grad(), model.trace(SOURCE, decoder_input_ids=TARGET):
        heads = model.decoder.layers[1].cross_attn.attention_head_outputs
        heads[:, :, 1] = 0
        logits = model.logits.save()

    def zero_head(module, args):
        merged = args[0].clone()
        merged.view(*merged.shape[:2], 4, 16)[:, :, 1] = 0
        return (merged,)

    inner = model._module
    handle = inner.model.decoder.layers[1].encoder_attn.out_proj.register_forward_pre_hook(zero_head)
    try:
        with torch.no_grad():
            expected = inner(SOURCE, decoder_input_ids=TARGET).logits
    finally:
        handle.remove()
    with torch.no_grad():
        plain = inner(SOURCE, decoder_input_ids=TARGET).logits
    assert torch.allclose(logits, expected, atol=1e-5)
    assert not torch.allclose(logits, plain, atol=1e-3)


def test_the_identities_catch_a_miswired_stack():
    """A decoder family that scales the scores as Whisper's pre-scaled queries need (by 1.0), or that attends both
    ways, fails the identities on mBART's decoder: they are not identities that hold whatever is read."""
    from attnlens.families.bart import PreNormBart, PreNormDecoder, WhisperScaling
    from attnlens.parts import scoring

    class Bidirectional(PreNormDecoder):
        class ScoreFunction(scoring.ScoreFunction):
            def causal(self, config):
                return False

    miswired = {
        "Unscaled": ({"decoder": type("Unscaled", (WhisperScaling, PreNormDecoder), {})}, "scores =="),
        "Bidirectional": ({"decoder": Bidirectional}, "visible entries positive"),
    }
    inner = attnlens.models.tiny_seq2seq_model("mbart")
    for name, (stacks, failed) in miswired.items():
        family = type(name, (PreNormBart,), stacks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = attnlens.StandardizedSeq2Seq(inner, tokenizer=attnlens.models.char_tokenizer(), family=family)
        saved = read_stacks(model, SOURCE, decoder_input_ids=TARGET)
        found = failures(model.decoder, saved["decoder"], 0)
        assert any(failure.startswith(failed) for failure in found), (name, found)
        assert failures(model.encoder, saved["encoder"], 0) == []


def test_reading_the_encoder_after_the_decoder_is_an_order_error_naming_both():
    model = tiny("bart")
    with pytest.raises(attnlens.OrderError) as raised:
        with model.trace(SOURCE, decoder_input_ids=TARGET):
            model.decoder.layers[0].layer_input.save()
            model.encoder.layers[1].layer_output.save()
    assert "encoder.layers[1].layer_output" in str(raised.value)
    assert model.encoder.order(0)["self_attn.attention_probabilities"] < model.encoder.order(0)["layer_output"]


def test_each_model_class_refuses_the_others_models_naming_the_right_one():
    bart = tiny("bart")._module
    with pytest.raises(TypeError, match="StandardizedSeq2Seq"):
        attnlens.StandardizedTransformer(bart, tokenizer=attnlens.models.char_tokenizer())
    llama = attnlens.models.tiny_model("llama")
    with pytest.raises(TypeError, match="StandardizedTransformer"):
        attnlens.StandardizedSeq2Seq(llama, tokenizer=attnlens.models.char_tokenizer())
    causal_bert = attnlens.models.tiny_model("bert")
    with pytest.raises(TypeError, match="attends causally"):
        attnlens.StandardizedEncoder(causal_bert, tokenizer=attnlens.models.char_tokenizer())
    model = attnlens.models.tiny("llama")
    reason = model.support(0)["cross_attn.attention_probabilities"]  # answered, though the table leaves it out
    assert reason.startswith("no cross-attention") and "cross_attn.attention_probabilities" not in list(
        model.support(0)
    )
    with pytest.raises(attnlens.Unavailable, match="no cross-attention"):
        with model.trace("Hello"):
            model.layers[0].cross_attn.attention_probabilities.save()


def test_an_encoder_serves_bidirectional_attention_as_standardized_encoder():
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    inner = transformers.BertForMaskedLM(config).eval()
    model = attnlens.StandardizedEncoder(inner, tokenizer=attnlens.models.char_tokenizer())
    with torch.no_grad(), model.trace("Hello"):
        pattern = model.layers[0].self_attn.attention_probabilities.save()
    assert (pattern[..., 0, 1:] > 0).all()
    with pytest.raises(ValueError, match="not an encoder head"):
        attnlens.StandardizedEncoder(inner, head="causal_lm")


def test_a_family_naming_a_module_the_model_lacks_is_refused_at_load():
    from attnlens.families.bart import Bart, BartDecoder

    class Misnamed(Bart):
        decoder = type("MisnamedDecoder", (BartDecoder,), {"cross_attention": "cross_attention"})

    inner = attnlens.models.tiny_seq2seq_model("bart")
    with pytest.raises(attnlens.Miswired, match="cross_attention = 'cross_attention' names no module"):
        attnlens.StandardizedSeq2Seq(inner, tokenizer=attnlens.models.char_tokenizer(), family=Misnamed)


def test_a_folder_loads_by_path_with_its_tokenizer(tmp_path):
    """A saved encoder-decoder (as a hub download lands) loads as `AutoModelForSeq2SeqLM` builds it."""
    inner = attnlens.models.tiny_seq2seq_model("bart")
    inner.save_pretrained(tmp_path)
    attnlens.models.char_tokenizer().save_pretrained(tmp_path)
    model = attnlens.StandardizedSeq2Seq(str(tmp_path))
    with torch.no_grad(), model.trace(SOURCE, decoder_input_ids=TARGET):
        logits = model.logits.save()
    with torch.no_grad():  # loaded at transformers' default attention (sdpa): equal up to its rounding
        assert torch.allclose(logits, inner(SOURCE, decoder_input_ids=TARGET).logits, atol=1e-5)
    assert model.num_layers == {"encoder": 2, "decoder": 2}
    assert model.decoder.support(0)["cross_attn.attention_probabilities"].startswith("read inside transformers' eager")


def test_t5s_position_bias_is_a_value_an_edit_of_which_moves_the_scores_and_the_logits():
    """Layer 0 of T5's encoder computes the bucketed bias (the identities check it against `compute_bias`); adding
    one to head 2's bias at every query-key pair adds one to its scores, leaves its pattern (a constant per row),
    and doubling it moves the pattern and the logits."""
    model = tiny("t5")
    attention = model.encoder.layers[0].self_attn
    with torch.no_grad(), model.trace(SOURCE, decoder_input_ids=TARGET):
        bias = attention.attention_position_bias.save()
        scores = attention.attention_scores.save()
        pattern = attention.attention_probabilities.save()
        logits = model.logits.save()
    assert bias.shape == (1, 4, SOURCE.shape[1], SOURCE.shape[1])
    shifted = bias.clone()
    shifted[:, 2] += 1.0
    with torch.no_grad(), model.trace(SOURCE, decoder_input_ids=TARGET):
        attention.attention_position_bias = shifted
        moved_scores = attention.attention_scores.save()
        moved_pattern = attention.attention_probabilities.save()
        same_logits = model.logits.save()
    assert torch.allclose(moved_scores - scores, (shifted - bias).expand_as(scores), atol=1e-5)
    assert torch.allclose(moved_pattern, pattern, atol=1e-6) and torch.allclose(same_logits, logits, atol=1e-5)
    with torch.no_grad(), model.trace(SOURCE, decoder_input_ids=TARGET):
        attention.attention_position_bias = bias * 2
        doubled = attention.attention_scores.save()
        moved_logits = model.logits.save()
    assert torch.allclose(doubled - scores, bias.expand_as(scores), atol=1e-5)
    assert not torch.allclose(moved_logits, logits, atol=1e-4)
    assert model.encoder.support(0)["self_attn.attention_position_bias"] is None
    assert model.encoder.support(0).notes["self_attn.attention_position_bias"].startswith("[1, num_heads")


def test_every_sequence_to_sequence_type_of_transformers_is_served_or_refused_with_its_reason():
    """transformers' two sequence-to-sequence registries (text, and speech), type by type from their configs: served
    (and then in this file's every-value test), or refused naming why and what serves it."""
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    from attnlens.stacks import refusal

    registries = (
        modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    )
    outcomes = {}
    for types in registries:
        for model_type in types:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    config = AutoConfig.for_model(model_type)
                except ValueError:  # EncoderDecoderConfig wants its two sub-configs (transformers 5.19)
                    config = SimpleNamespace(model_type=model_type, is_encoder_decoder=True)
                said = refusal(config)
            outcomes[model_type] = said
            if model_type in TYPES:
                assert said is None, model_type
            else:
                assert said and ("StandardizedTransformer" in said or "attnlens has no encoder-decoder" in said)
    served = sorted(t for t, said in outcomes.items() if said is None)
    assert served == sorted(t for t in TYPES if t in outcomes)
    print(f"{len(outcomes)} types: {len(served)} served, {len(outcomes) - len(served)} refused with the reason")


@pytest.mark.parametrize("attention", ["cross", "encoder", "decoder"])
def test_show_and_plot_draw_each_attention_of_an_encoder_decoder_with_source_and_target_tokens(attention, tmp_path):
    """`show`/`plot` on an encoder-decoder: the tokens are the source's then the target's; cross-attention's rows are
    the target's and its keys the source's, the encoder's both the source's, the decoder's both the target's; each
    pattern is the one `cross_attn` / `self_attn` serves."""
    from attnlens.show import patterns

    model = tiny("bart")
    found = patterns(model, SOURCE[0], [0, 1], target=TARGET[0], attention=attention)
    source, target = SOURCE.shape[1], TARGET.shape[1]
    assert len(found.tokens) == source + target
    stack, sublayer = (
        ("encoder", "self_attn")
        if attention == "encoder"
        else ("decoder", {"cross": "cross_attn"}.get(attention, "self_attn"))
    )
    expected = []  # (a name bound in a trace body does not outlive it; a list from outside does)
    with torch.no_grad(), model.trace(SOURCE, decoder_input_ids=TARGET):
        for layer in (0, 1):
            expected.append(getattr(getattr(model, stack).layers[layer], sublayer).attention_probabilities.save())
    on_source, on_target = list(range(source)), list(range(source, source + target))
    for layer, pattern in zip(found.layers, expected):
        assert torch.equal(layer.probs, pattern[0])
        assert layer.query_positions == (on_source if attention == "encoder" else on_target)
        assert layer.key_positions == (on_target if attention == "decoder" else on_source)
    assert attention in found.model
    page = page_data(attnlens.show(model, SOURCE[0], [0, 1], target=TARGET[0], attention=attention).html())
    assert page["tokens"] == found.tokens
    for shown, layer in zip(page["layers"], found.layers):
        assert (shown["queries"], shown["keys"]) == (layer.query_positions, layer.key_positions)
        assert close(shown["weights"], layer.probs)  # one byte a weight
    assert (
        attnlens.plot(model, SOURCE[0], 1, target=TARGET[0], attention=attention, out=tmp_path / "p.png").stat().st_size
    )


def test_show_on_an_encoder_decoder_says_what_is_missing_or_wrong():
    model = tiny("bart")
    with pytest.raises(ValueError, match="attention= is one of"):
        attnlens.show(model, SOURCE[0], 0, target=TARGET[0], attention="both")
    with pytest.raises(ValueError, match="target="):
        attnlens.show(model, SOURCE[0], 0)
    with pytest.raises(IndexError, match="layer 5 is out of range"):
        attnlens.show(model, SOURCE[0], 5, target=TARGET[0])
    with pytest.raises(ValueError, match="not an encoder-decoder"):
        attnlens.show(attnlens.models.tiny("gpt2"), "Hi", 0, target="Hi")


def test_whispers_positions_are_its_audio_in_time():
    """`model.positions(input_features)`: one encoder position per 20 ms (two 10 ms frames), as many as the encoder
    forms. A change to the frames of one instant moves the encoder's first block input only at the position
    covering it and its neighbours (the kernels' reach); a text encoder's positions are refused."""
    model = tiny("whisper")
    features = source("whisper")["input_features"]
    positions = model.positions(features)
    with torch.no_grad(), model.trace(input_features=features, decoder_input_ids=TARGET):
        plain = model.encoder.layers[0].layer_input.save()
    assert len(positions.start) == plain.shape[1] == 32
    torch.testing.assert_close(positions.end - positions.start, torch.full((32,), 0.02, dtype=torch.float64))
    for frame in (0, 21, 40, 63):
        moved = features.clone()
        moved[..., frame] += 1.0
        with torch.no_grad(), model.trace(input_features=moved, decoder_input_ids=TARGET):
            changed = model.encoder.layers[0].layer_input.save()
        where = (changed - plain).abs().amax(-1)[0].nonzero().flatten().tolist()
        covering = positions.at(frame * 0.01 + 0.005)  # the middle of the frame
        assert covering == frame // 2 and covering in where and max(abs(p - covering) for p in where) <= 1, where
    assert list(positions.frame().columns) == ["position", "start", "end"]
    with pytest.raises(attnlens.Unavailable, match="no convolutions over time"):
        tiny("t5").positions(SOURCE)


@pytest.mark.parametrize("model_type", TYPES)
def test_the_decoders_kv_cache_is_what_earlier_steps_received_and_an_edit_lands_as_by_hand(model_type):
    """The decoder's self-attention cache (the half of transformers' `EncoderDecoderCache` it keeps for itself): at
    each step, the keys and values the earlier steps' attention received; a cached key overwritten at the second
    step moves its logits exactly as transformers run by hand on the same edited cache; a removed position is never
    read again (on T5, whose attention takes its mask inside position_bias, and FSMT, whose takes attn_mask, removing
    is refused with the reason)."""
    model = tiny(model_type)
    attn = model.decoder.layers[1].self_attn
    # use_cache: FSMT's tiny config turns it off (its plain forward masks causally only without a cache)
    kwargs = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, use_cache=True)
    keys, values, cached_keys, cached_values = [], [], [], []
    with torch.no_grad(), model.generate(**source(model_type), **kwargs) as tracer:
        for _ in tracer.iter[0:3]:
            cached_keys.append(attn.attention_cache_keys.save())
            cached_values.append(attn.attention_cache_values.save())
            keys.append(attn.attention_keys.save())
            values.append(attn.attention_values.save())
        tokens = tracer.result.save()
    assert cached_keys[0].shape[2] == 0
    for step in (1, 2):  # the keys the step before attended over (its cache and its own), as they were
        assert cached_keys[step].shape[2] == step
        assert torch.equal(cached_keys[step], keys[step - 1]) and torch.equal(cached_values[step], values[step - 1])

    def overwritten(cached):  # the first position's key made large: it draws the attention (tiny models move little)
        cached = cached.clone()
        cached[..., 0, :] = 4.0
        return cached

    with torch.no_grad(), model.generate(**source(model_type), **kwargs) as tracer:
        edited = list().save()
        for step in tracer.iter[0:2]:
            if step == 1:
                attn.attention_cache_keys = overwritten(attn.attention_cache_keys)
                edited.append(model.logits[:, -1].clone())
    hf = model._module
    start = torch.tensor([[hf.generation_config.decoder_start_token_id]])
    generated = tokens[:, -3:-2]  # the first of the three (Whisper's result leaves out the start token)
    encoded = source(model_type)
    if model_type == "pop2piano":  # its generate prepends a composer's embedding to the features
        conditioned = hf.get_mel_conditioner_outputs(
            **encoded, composer="composer1", generation_config=hf.generation_config
        )
        encoded = {"inputs_embeds": conditioned[0]}
    # (Switch Transformers' forward hands use_cache on to its encoder, which refuses it; its decoder caches by default)
    caching = {} if model_type == "switch_transformers" else {"use_cache": True}
    with torch.no_grad():
        cache = hf(**encoded, decoder_input_ids=start, **caching).past_key_values
        layer = cache.self_attention_cache.layers[1]
        layer.keys = overwritten(layer.keys)
        expected = hf(**encoded, decoder_input_ids=generated, past_key_values=cache).logits[:, -1]
        cache = hf(**encoded, decoder_input_ids=start, **caching).past_key_values
        unedited = hf(**encoded, decoder_input_ids=generated, past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(edited[0], expected, atol=1e-5, rtol=1e-5)
    assert float((expected - unedited).abs().max()) > 1e-4  # the edit moved them, past the tolerance tenfold
    reason = model.support(1)["self_attn.attention_cache_visible"]
    masked_otherwise = {
        **dict.fromkeys(("t5", "mt5", "umt5", "switch_transformers", "pop2piano"), "position_bias"),
        "fsmt": "attn_mask",
    }
    if model_type in masked_otherwise:
        assert masked_otherwise[model_type] in reason
        return
    assert reason is None
    with torch.no_grad(), model.generate(**source(model_type), **kwargs) as tracer:
        rows = list().save()
        for step in tracer.iter[0:3]:
            if step == 1:
                visible = attn.attention_cache_visible.clone()
                visible[:, 0] = False
                attn.attention_cache_visible = visible
            rows.append(attn.attention_probabilities[0, :, -1].clone())
    assert (rows[0] > 0).all() and bool((rows[1][:, 0] == 0).all()) and bool((rows[2][:, 0] == 0).all())
    torch.testing.assert_close(rows[2].sum(-1), torch.ones(rows[2].shape[0]))
