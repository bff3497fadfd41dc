"""The arithmetic of their own that the encoder-decoders of attnlens/families/bart_like.py carry: NLLB-MoE's sparse MLP
(recomputed by hand from its router and experts), MVP's prompts (extra keys and values before the sequence's),
FSMT's time-first blocks (an edit of a batch-first value lands where a hook on the time-first tensor puts it; the
decoder's mask follows config.use_cache as FSMTModel's does), and BigBirdPegasus's block-sparse encoder (refused
with the reason, the rest of the block still equal to transformers)."""

import warnings

import pytest
import torch

import attnlens
from attnlens.checks import failures, read_stacks

SOURCE = torch.tensor([[5, 6, 7, 8, 9, 10]])
SHIFT = torch.linspace(-2.0, 2.0, 64)
TARGET = torch.tensor([[2, 11, 12, 13]])


def tiny(model_type: str, **overrides) -> attnlens.StandardizedSeq2Seq:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attnlens.models.tiny_seq2seq(model_type, **overrides)


def hooked_logits(inner, module, edit, source=SOURCE):
    """The plain model's logits with `edit` applied to `module`'s output (a forward hook)."""

    def hook(_, args, output):
        return edit(output)

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return inner(source, decoder_input_ids=TARGET).logits
    finally:
        handle.remove()


# --- NLLB-MoE -------------------------------------------------------------------------------------------------


def test_nllb_moes_sparse_mlp_output_is_its_router_and_experts_by_hand_and_an_edit_lands_as_a_hook_predicts():
    """Block 1 of each stack is sparse (encoder_sparse_step 2), block 0 dense. On the sparse block the served
    mlp_output is the gates of NllbMoeTop2Router times the experts NllbMoeExperts runs, recomputed here by hand from
    mlp_input (the experts as transformers picks them: by the values of the one-hot router mask, the note says so);
    on the dense block it is fc2(act(fc1(x))). Zeroing the sparse output at one position moves the logits as a hook
    on transformers' `ffn` does."""
    model = tiny("nllb-moe")
    for stack in ("encoder", "decoder"):
        layers = getattr(model, stack).layers
        with torch.no_grad(), model.trace(SOURCE, decoder_input_ids=TARGET):
            dense_in, dense_out = layers[0].mlp_input.save(), layers[0].mlp.mlp_output.save()
            sparse_in, sparse_out = layers[1].mlp_input.save(), layers[1].mlp.mlp_output.save()
        dense, sparse = layers[0]._module.ffn, layers[1]._module.ffn
        with torch.no_grad():
            assert torch.allclose(dense_out, dense.fc2(dense.act(dense.fc1(dense_in))), atol=1e-6)
            x = sparse_in.reshape(-1, sparse_in.shape[-1])
            top_1, gates, _ = sparse.router(x)
            experts = [sparse.experts[f"expert_{e}"](x) for e in range(sparse.num_experts)]
            first, second = (gates * top_1).sum(-1, keepdim=True), (gates * (1 - top_1)).sum(-1, keepdim=True)
            by_hand = (1 - sparse.experts.moe_token_dropout) * (experts[1] * first + experts[0] * second)
        assert bool((gates > 0).sum(-1).eq(2).all()), "every token has two gates"
        assert torch.allclose(sparse_out.reshape(by_hand.shape), by_hand, atol=1e-5), stack
        routed = sum(experts[e] * gates[:, e, None] for e in range(sparse.num_experts))
        assert not torch.allclose(sparse_out.reshape(by_hand.shape), routed, atol=1e-3)  # the check can fail
    note = model.encoder.support(1).notes["mlp.mlp_output"]
    assert "expert_1(x) * its top-1 gate" in note
    assert "mlp.mlp_activation" in model.encoder.support(1).reasons
    assert model.encoder.support(0)["mlp.mlp_activation"] is None

    def zero_position_2(output):
        output = output.clone()
        output[:, 2] = 0
        return output

    with torch.no_grad(), model.trace(SOURCE, decoder_input_ids=TARGET):
        out = model.decoder.layers[1].mlp.mlp_output
        model.decoder.layers[1].mlp.mlp_output = zero_position_2(out)
        edited = model.logits.save()
    inner = model._module
    expected = hooked_logits(inner, inner.model.decoder.layers[1].ffn, zero_position_2)
    torch.testing.assert_close(edited, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(expected, inner(SOURCE, decoder_input_ids=TARGET).logits, atol=1e-4)


# --- MVP --------------------------------------------------------------------------------------------------------


def test_mvps_prompts_are_keys_and_values_before_the_sequences_equal_to_transformers_and_to_mvp_prompt():
    """With `use_prompt`, each decoder block's keys and values begin with its prompt's (MvpPrompt over the prompt
    ids, one per block: the self-attention's and the cross-attention's), which every query sees; the pattern is
    transformers' own (`output_attentions`), the logits too. The keys' positions are refused (the prompt's have none).
    MvpModel builds its encoder without prompts (it hands use_prompt to another argument): its keys are the
    sequence's, and its notes say why."""
    length = 3
    model = tiny("mvp", use_prompt=True, prompt_length=length, prompt_mid_dim=32)
    saved = read_stacks(model, input_ids=SOURCE, decoder_input_ids=TARGET)
    with torch.no_grad():
        reference = model._module(SOURCE, decoder_input_ids=TARGET, output_attentions=True)
    encoder, decoder = saved["encoder"], saved["decoder"]
    inner = model._module.model
    ids = torch.arange(length)
    with torch.no_grad():
        prompts = {
            "decoder": inner.decoder.self_attn_prompt(ids),
            "cross": inner.decoder.cross_attn_prompt(ids),
        }
    for layer in range(2):
        assert torch.equal(encoder[(layer, "attention_probabilities")], reference.encoder_attentions[layer])
        assert torch.equal(decoder[(layer, "attention_probabilities")], reference.decoder_attentions[layer])
        assert torch.equal(decoder[(layer, "cross_attention_probabilities")], reference.cross_attentions[layer])
        assert encoder[(layer, "attention_keys")].shape[2] == SOURCE.shape[1]
        for prefix, prompt, sequence in (("", prompts["decoder"], TARGET), ("cross_", prompts["cross"], SOURCE)):
            keys, vals = decoder[(layer, f"{prefix}attention_keys")], decoder[(layer, f"{prefix}attention_values")]
            assert keys.shape[2] == length + sequence.shape[1]
            torch.testing.assert_close(keys[0, :, :length], prompt[layer][0], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(vals[0, :, :length], prompt[layer][1], atol=1e-6, rtol=1e-6)
    pattern = decoder[(0, "attention_probabilities")]
    assert (pattern[..., :length] > 0).all(), "every decoder position sees the whole prompt"
    assert (pattern[..., 0, length + 1 :] == 0).all(), "and the sequence causally after it"
    assert torch.equal(decoder["logits"], reference.logits)
    support = model.decoder.support(0)
    assert "prompt_length prompt keys" in support["self_attn.attention_key_positions"]
    assert support.notes["self_attn.attention_keys"].startswith("the block's prompt keys")
    assert support.notes["cross_attn.attention_keys"].startswith("the block's prompt keys")
    with pytest.raises(attnlens.Unavailable, match="prompt"):
        with model.trace(SOURCE, decoder_input_ids=TARGET):
            model.decoder.layers[0].self_attn.attention_key_positions.save()
    assert "without prompts" in model.encoder.support(0).notes["self_attn.attention_keys"]
    assert model.encoder.support(0)["self_attn.attention_key_positions"] is None
    plain = tiny("mvp")
    assert "prompt" not in str(plain.decoder.support(0).notes.get("self_attn.attention_keys", ""))
    assert "self_attn.attention_keys" not in plain.encoder.support(0).notes


# --- FSMT -------------------------------------------------------------------------------------------------------


def test_fsmts_time_first_blocks_are_served_batch_first_and_an_edit_lands_where_a_hook_puts_it():
    """FSMT's blocks take and return [seq, batch, hidden]; attnlens serves [batch, seq, hidden] views. Adding a
    vector at source position 2 of encoder block 0's output moves the logits as a hook adding it at [2, 0] of the
    time-first tensor does (not a constant one: the next block's LayerNorm would remove it)."""
    model = tiny("fsmt")
    with torch.no_grad(), model.trace(SOURCE, decoder_input_ids=TARGET):
        output = model.encoder.layers[0].layer_output
        shape = output.shape.save()
        output[:, 2] += SHIFT
        edited = model.logits.save()
    assert tuple(shape) == (1, SOURCE.shape[1], 64)

    def add_at_2(output):
        hidden = output[0].clone()
        hidden[2, 0] += SHIFT
        return (hidden, *output[1:])

    inner = model._module
    expected = hooked_logits(inner, inner.model.encoder.layers[0], add_at_2)
    torch.testing.assert_close(edited, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(expected, inner(SOURCE, decoder_input_ids=TARGET).logits, atol=1e-4)
    assert "time-first" in model.encoder.support(0).notes["layer_output"]


def test_fsmts_decoder_attends_both_ways_where_its_config_keeps_a_cache_as_transformers_does():
    """FSMTModel builds the causal mask only without a cache: on a config with `use_cache` (FSMT's default) a target
    read in one forward attends both ways, and attnlens's score function and identities say the same."""
    model = tiny("fsmt", use_cache=True)
    saved = read_stacks(model, input_ids=SOURCE, decoder_input_ids=TARGET)
    with torch.no_grad():
        reference = model._module(SOURCE, decoder_input_ids=TARGET, output_attentions=True)
    pattern = saved["decoder"][(0, "attention_probabilities")]
    assert torch.equal(pattern, reference.decoder_attentions[0])
    assert (pattern[..., 0, 1:] > 0).all()
    assert failures(model.decoder, saved["decoder"], 0) == []
    assert "both ways" in model.decoder.support(0).notes["self_attn.attention_probabilities"]
    assert tiny("fsmt").decoder.support(0).notes["self_attn.attention_probabilities"].startswith("causal")


# --- BigBirdPegasus ---------------------------------------------------------------------------------------------


def test_bigbird_pegasus_block_sparse_encoder_attention_is_refused_and_the_rest_equals_transformers():
    """With attention_type='block_sparse' (a source long enough for it: more than (5 + 2 * num_random_blocks) *
    block_size tokens), the encoder's queries, keys, pattern and head outputs are refused with the reason; the
    blocks' inputs and outputs are still transformers' own, the identities still hold, and the decoder is served."""
    model = tiny("bigbird_pegasus", attention_type="block_sparse", block_size=2, num_random_blocks=1)
    source = torch.arange(5, 25)[None]  # 20 tokens, a multiple of block_size: no padding
    report = model.encoder.support(0)
    assert "block_sparse" in report["self_attn.attention_probabilities"]
    assert report["self_attn.attention_premix"] is None and report["layer_output"] is None
    assert model.decoder.support(0)["self_attn.attention_probabilities"] is None
    with pytest.raises(attnlens.Unavailable, match="block_sparse"):
        with model.trace(source, decoder_input_ids=TARGET):
            model.encoder.layers[0].self_attn.attention_probabilities.save()
    saved = read_stacks(model, input_ids=source, decoder_input_ids=TARGET)
    with torch.no_grad():
        reference = model._module(source, decoder_input_ids=TARGET, output_hidden_states=True)
    assert model._module.model.encoder.attention_type == "block_sparse", "the source was long enough"
    for layer in range(2):
        assert torch.equal(saved["encoder"][(layer, "layer_input")], reference.encoder_hidden_states[layer])
        assert failures(model.encoder, saved["encoder"], layer) == []
        assert failures(model.decoder, saved["decoder"], layer) == []
    assert torch.equal(saved["decoder"]["logits"], reference.logits)


# --- LED --------------------------------------------------------------------------------------------------------


def test_leds_local_window_encoder_refuses_its_attentions_values_and_serves_the_rest_with_global_tokens_and_padding():
    """LED's encoder attends in Longformer's local windows plus global tokens: its queries, keys, pattern and head
    outputs are refused with that reason; with a global token and a source padded to the window (7 tokens, window
    6: 12 positions in the blocks) its blocks' values are transformers' own (hidden states, the identities), the
    merged heads and output included, and the decoder is served whole."""
    model = tiny("led")
    source = torch.arange(5, 12)[None]
    global_mask = torch.zeros_like(source)
    global_mask[:, 0] = 1
    report = model.encoder.support(0)
    for name in ("attention_queries", "attention_keys", "attention_probabilities", "attention_head_outputs"):
        assert report[f"self_attn.{name}"].startswith("LED's encoder attends as Longformer does")
    assert report["self_attn.attention_premix"] is None
    assert "pads the source" in report.notes["layer_input"]
    with pytest.raises(attnlens.Unavailable, match="Longformer"):
        with model.trace(source, decoder_input_ids=TARGET):
            model.encoder.layers[0].self_attn.attention_probabilities.save()
    inputs = dict(input_ids=source, global_attention_mask=global_mask, decoder_input_ids=TARGET)
    saved = read_stacks(model, **inputs)
    with torch.no_grad():
        reference = model._module(**inputs, output_hidden_states=True, output_attentions=True)
    assert saved["encoder"][(0, "layer_input")].shape == (1, 12, 64)
    assert reference.encoder_global_attentions is not None, "the global token took part"
    for layer in range(2):
        assert failures(model.encoder, saved["encoder"], layer) == []
        assert failures(model.decoder, saved["decoder"], layer) == []
        torch.testing.assert_close(
            saved["encoder"][(layer, "layer_input")][:, :7], reference.encoder_hidden_states[layer][:, :7]
        )
        assert torch.equal(
            saved["decoder"][(layer, "cross_attention_probabilities")], reference.cross_attentions[layer]
        )
    assert torch.equal(saved["decoder"]["logits"], reference.logits)


# --- PEGASUS-X --------------------------------------------------------------------------------------------------


def test_pegasus_xs_block_local_encoder_serves_the_sequence_stream_and_a_staggered_output_edit_lands_by_hand():
    """PEGASUS-X's encoder attends within blocks plus global tokens: its attention's own values and merged heads are
    refused with that reason. On a source padded to the block (7 tokens, blocks of 2: 8 positions) its blocks' values
    are the sequence stream's (transformers' hidden states; the identities hold through norms and an MLP that also
    run on the global tokens). Block 1 is staggered: its attention ran over the sequence padded by half a block on
    each side, and an edit of its served output at position 3 lands where a hook puts it, at padded position 4."""
    model = tiny("pegasus_x")
    source = torch.arange(5, 12)[None]
    report = model.encoder.support(1)
    for name in ("attention_probabilities", "attention_keys", "attention_premix"):
        assert report[f"self_attn.{name}"].startswith("PEGASUS-X's encoder attends in blocks")
    assert "staggered" in report.notes["self_attn.attention_output"]
    assert "staggered" not in model.encoder.support(0).notes.get("self_attn.attention_output", "")
    saved = read_stacks(model, input_ids=source, decoder_input_ids=TARGET)
    with torch.no_grad():
        reference = model._module(source, decoder_input_ids=TARGET, output_hidden_states=True)
    for layer in range(2):
        assert saved["encoder"][(layer, "layer_input")].shape == (1, 8, 64)
        assert torch.equal(saved["encoder"][(layer, "layer_input")], reference.encoder_hidden_states[layer])
        assert failures(model.encoder, saved["encoder"], layer) == []
        assert failures(model.decoder, saved["decoder"], layer) == []
    assert torch.equal(saved["decoder"]["logits"], reference.logits)
    with torch.no_grad(), model.trace(source, decoder_input_ids=TARGET):
        output = model.encoder.layers[1].self_attn.attention_output
        output[:, 3] += SHIFT
        edited = model.logits.save()

    def add_at_padded_4(output):
        local = output[0].clone()
        local[:, 4] += SHIFT
        return (local, *output[1:])

    inner = model._module
    expected = hooked_logits(inner, inner.model.encoder.layers[1].self_attn, add_at_padded_4, source)
    torch.testing.assert_close(edited, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(expected, inner(source, decoder_input_ids=TARGET).logits, atol=1e-4)


def test_the_embeddings_note_of_each_pre_norm_type_says_how_its_own_positions_join():
    """mBART, Pegasus, Blenderbot and M2M100 share one family; only mBART normalises the embedded tokens, and
    Pegasus's and M2M100's positions are sinusoidal: each type's note says its own steps (transformers' code)."""
    from transformers import AutoConfig

    from attnlens.families.bart import PreNormEncoder

    said = {
        t: PreNormEncoder().notes(AutoConfig.for_model(t), 0)["embeddings"] for t in ("mbart", "pegasus", "m2m_100")
    }
    said["blenderbot"] = PreNormEncoder().notes(AutoConfig.for_model("blenderbot"), 0)["embeddings"]
    assert [t for t, note in said.items() if "layernorm_embedding" in note] == ["mbart"]
    assert [t for t, note in said.items() if "sinusoidal" in note] == ["pegasus", "m2m_100"]
