"""The decoders of BART's encoder-decoders run alone as causal LMs (`families/bart_causal.py`: `BartForCausalLM`,
`MBartForCausalLM`, `WhisperForCausalLM`, ...) through `StandardizedTransformer`, against transformers' own arithmetic:
every pattern equals `output_attentions`, the identities hold on every block, the cross-attention each block holds is
answered as absent because it never runs, an edit recomputes by hand as the block's norms say (post-norm or pre-norm,
with no cross-attention between), the self-attention cache is a plain `DynamicCache` read and edited as any decoder's,
and the encoder-decoder classes stay with `StandardizedSeq2Seq`."""

import functools
import warnings

import pytest
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import attnlens
from attnlens import verification
from attnlens.checks import failures, read_everything
from attnlens.families import bart, bart_causal
from attnlens.family import TINY_DEFAULTS
from attnlens.values import WITH_CROSS_ATTENTION

PROMPT = "Hello world, again"
#: Every type served, and its family (the family's first type builds from its recipe's own config class).
SERVED = {
    "bart": bart_causal.BartCausalLM,
    "plbart": bart_causal.BartCausalLM,
    "blenderbot-small": bart_causal.BartCausalLM,
    "marian": bart_causal.BartCausalLM,
    "mvp": bart_causal.MvpCausalLM,
    "mbart": bart_causal.PreNormCausalLM,
    "pegasus": bart_causal.PreNormCausalLM,
    "blenderbot": bart_causal.PreNormCausalLM,
    "bigbird_pegasus": bart_causal.BigBirdPegasusCausalLM,
    "whisper": bart_causal.WhisperCausalLM,
}
POST_NORM = ("bart", "plbart", "blenderbot-small", "marian", "mvp")


def causal_lm(model_type: str) -> torch.nn.Module:
    """The type's `...ForCausalLM` (transformers' causal-LM registry), tiny from its family's recipe, eager, seeded,
    its norms perturbed."""
    kwargs = {**TINY_DEFAULTS, **SERVED[model_type].tiny.kwargs}
    config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in kwargs.items() if v is not None})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return attnlens.models._perturbed(
        getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config).eval()
    )


@functools.cache
def served(model_type: str) -> attnlens.StandardizedTransformer:
    return attnlens.StandardizedTransformer(causal_lm(model_type), tokenizer=attnlens.models.char_tokenizer())


@pytest.mark.parametrize("model_type", sorted(SERVED))
def test_every_pattern_equals_output_attentions_of_the_causal_lm_and_every_identity_holds(model_type):
    model = served(model_type)
    inner = model._module
    assert type(model.family) is SERVED[model_type] and not inner.config.is_encoder_decoder
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[]] * model.num_layers
    verification.verify(model)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = inner(ids, output_attentions=True, output_hidden_states=True)
    assert len(reference.attentions) == model.num_layers == 3
    for layer in range(model.num_layers):
        pattern = saved[(layer, "attention_probabilities")]
        assert torch.equal(pattern, reference.attentions[layer]), layer
        assert torch.equal(saved[(layer, "layer_input")], reference.hidden_states[layer]), layer
        assert (pattern[..., 0, 1:] == 0).all() and (pattern[..., -1, :] > 0).all()  # causal, every key seen last
        assert pattern[..., -1, :].max() > 1.5 / pattern.shape[-1]  # wide weights: the last row is not uniform
    last = saved.get("final_norm_output", saved[(model.num_layers - 1, "layer_output")])
    assert torch.equal(last, reference.hidden_states[-1])
    assert torch.equal(saved["logits"], reference.logits)
    assert ("final_norm_output" in saved) == (model_type not in POST_NORM)


@pytest.mark.parametrize("model_type", sorted(SERVED))
def test_the_cross_attention_each_block_holds_never_runs_and_is_answered_absent(model_type):
    """Each block holds its cross-attention (`cross_attn` is that module); a forward on token ids never calls it, and
    every cross value is unavailable saying so, in `support()`'s table and when read: served as present, this
    fails."""
    model = served(model_type)
    block = model._module.model.decoder.layers[0]
    assert model.layers[0].cross_attn._module is block.encoder_attn
    calls = []
    hooks = [
        layer.encoder_attn.register_forward_pre_hook(lambda *_: calls.append(1))
        for layer in model._module.model.decoder.layers
    ]
    try:
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[0].layer_output.save()
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == []
    support = model.support(0)
    cross = [key for key in support if key.startswith(("cross_", "cross_attn."))]
    assert len(cross) == len(WITH_CROSS_ATTENTION) == len(support.unavailable.keys() & set(cross))
    for key in cross:
        assert "never runs" in support[key] and "without encoder states" in support[key], key
    assert not any(name in WITH_CROSS_ATTENTION for name in model.family.locations())
    with pytest.raises(attnlens.Unavailable, match="never runs"), torch.no_grad(), model.trace(PROMPT):
        model.layers[1].cross_attn.attention_probabilities.save()
    with pytest.raises(attnlens.Unavailable, match="never runs"), torch.no_grad(), model.trace(PROMPT):
        model.layers[0].cross_attention_input.save()


@pytest.mark.parametrize("model_type", ["bart", "mbart", "whisper"])
def test_an_edit_of_the_attention_output_recomputes_by_hand_with_no_cross_attention_between(model_type):
    """Layer 1's attention output scaled by 3: its block output is the block's own norms and MLP on the edited sum,
    with nothing between the self-attention and the MLP; post-norm (BART) normalises the sum with
    `self_attn_layer_norm` and the MLP reads that, pre-norm (mBART, Whisper) adds the MLP of `final_layer_norm`'s
    output to the sum."""
    model = served(model_type)
    block = model._module.model.decoder.layers[1]
    with torch.no_grad(), model.trace(PROMPT):
        attention = model.layers[1].self_attn
        stream = model.layers[1].layer_input.save()
        edited = (attention.attention_output * 3).save()
        attention.attention_output = edited
        mid = model.layers[1].layer_mid.save()
        output = model.layers[1].layer_output.save()
    with torch.no_grad():
        mlp = lambda x: block.fc2(block.activation_fn(block.fc1(x)))  # noqa: E731
        if model_type in POST_NORM:
            normed = block.self_attn_layer_norm(stream + edited)
            expected = block.final_layer_norm(normed + mlp(normed))
        else:
            expected = stream + edited + mlp(block.final_layer_norm(stream + edited))
    assert torch.allclose(mid, stream + edited, atol=1e-6)
    assert torch.allclose(output, expected, atol=1e-5)
    # the decoder family's wiring (the MLP reading the cross-attention's norm) is another number here
    if model_type in POST_NORM:
        wired = block.final_layer_norm(
            block.encoder_attn_layer_norm(normed) + mlp(block.encoder_attn_layer_norm(normed))
        )
        assert not torch.allclose(output, wired, atol=1e-3)


@pytest.mark.parametrize("model_type", ["bart", "mvp", "whisper"])
def test_the_self_attention_cache_is_a_dynamic_cache_read_and_edited_as_any_decoders(model_type):
    """Generating, the cache at step 1 holds the keys layer 1's attention received at step 0; keys overwritten at one
    position move the next step's logits as transformers run by hand on the edited cache (BART's attention, MVP's
    folded heads, Whisper's)."""
    model = served(model_type)
    hf = model._module
    ids = model.tokenizer("Hello world", return_tensors="pt").input_ids
    torch.manual_seed(1)
    new_key = torch.randn(1, 4, 16)
    saved = {}
    with torch.no_grad(), model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0) as tracer:
        logits = list().save()
        steps = dict().save()
        for step in tracer.iter[:2]:
            attention = model.layers[1].self_attn
            if step == 1:
                steps["cached"] = attention.attention_cache_keys.clone()
                keys = attention.attention_cache_keys
                keys[:, :, 3] = new_key
                attention.attention_cache_keys = keys
            steps[step] = attention.attention_keys.clone()
            logits.append(model.logits[:, -1].clone())
    saved.update(steps)
    assert torch.equal(saved["cached"], saved[0])  # what step 0's attention received, positions 0 .. 10
    assert torch.equal(saved[1][:, :, 3], new_key)
    with torch.no_grad():
        first = hf(ids, use_cache=True)
        cache = first.past_key_values
        assert type(cache).__name__ == "DynamicCache"
        clean = hf(first.logits[:, -1:].argmax(-1), past_key_values=cache).logits[:, -1]
        first = hf(ids, use_cache=True)
        cache = first.past_key_values
        cache.layers[1].keys[:, :, 3] = new_key
        by_hand = hf(first.logits[:, -1:].argmax(-1), past_key_values=cache).logits[:, -1]
    assert torch.allclose(logits[1], by_hand, atol=1e-5) and not torch.allclose(logits[1], clean, atol=1e-3)


def test_the_encoder_decoder_classes_stay_with_standardized_seq2seq():
    """The same model types: the causal LM is `family_for`'s, the encoder-decoder `encoder_decoder_for`'s;
    `StandardizedTransformer` refuses the encoder-decoder, `StandardizedSeq2Seq` the causal LM, each naming the
    other."""
    for model_type, family in SERVED.items():
        assert type(attnlens.family_for(model_type)) is family
    assert isinstance(attnlens.registry.encoder_decoder_for("bart"), bart.Bart)
    assert isinstance(attnlens.registry.encoder_decoder_for("whisper"), bart.Whisper)
    seq2seq = attnlens.models.tiny_seq2seq_model("bart")
    with pytest.raises(TypeError, match="StandardizedSeq2Seq"):
        attnlens.StandardizedTransformer(seq2seq, tokenizer=attnlens.models.char_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        both = attnlens.StandardizedSeq2Seq(seq2seq, tokenizer=attnlens.models.char_tokenizer())
    assert both.decoder.family.name == "BartDecoder" and both.decoder.support(0)["cross_attn.attention_keys"] is None
    with pytest.raises(TypeError, match=r"not an encoder-decoder.*StandardizedTransformer"):
        attnlens.StandardizedSeq2Seq(causal_lm("bart"), tokenizer=attnlens.models.char_tokenizer())


def test_a_saved_causal_lm_loads_by_path_as_the_causal_lm(tmp_path):
    """A saved `BartForCausalLM` keeps `is_encoder_decoder = False` in its config: loaded by path, it is the causal LM
    (`AutoModelForCausalLM`), served by its family."""
    inner = causal_lm("bart")
    inner.save_pretrained(tmp_path)
    attnlens.models.char_tokenizer().save_pretrained(tmp_path)
    model = attnlens.StandardizedTransformer(str(tmp_path), attn_implementation="eager")
    assert type(model._module).__name__ == "BartForCausalLM" and model.family.name == "BartCausalLM"
    with torch.no_grad(), model.trace(PROMPT):
        pattern = model.layers[2].self_attn.attention_probabilities.save()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(pattern, inner(ids, output_attentions=True).attentions[2])


@pytest.mark.parametrize("model_type", ["bart", "mbart"])
def test_encoder_states_are_refused_where_the_cross_attention_would_run_past_what_is_served(model_type):
    """Given encoder_hidden_states the causal LM would run its cross-attention, which the family serves as never
    running (a post-norm block's MLP would then read another norm): refused before the forward, naming the way."""
    model = served(model_type)
    states = torch.zeros(1, 3, model.config.hidden_size)
    with pytest.raises(ValueError, match=r"encoder_hidden_states: .*StandardizedSeq2Seq"):
        with torch.no_grad(), model.trace(PROMPT, encoder_hidden_states=states):
            model.layers[0].layer_output.save()
