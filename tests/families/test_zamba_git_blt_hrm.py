"""Zamba and Zamba2: the shared attention blocks of the hybrid layers, what the Mamba layers serve, and the residual
values of a layout whose attention joins the stream only through its MLP, `linear` and a Mamba layer.

What the shared identities can't see: that the attention reads the norm of concat(layer_input, embeddings); that its
output enters pre_ff_layernorm with no residual; that the tied blocks are addressed per layer (one layer's values and
edits are its own); Zamba2's per-layer adapters in the queries, keys and values; the precise reasons on both kinds
of layer.
"""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, read_everything

#: case -> (hybrid layers, Mamba layers)
CASES = {"zamba": ((2, 3), (0, 1, 4)), "zamba2": ((1, 3, 4), (0, 2)), "zamba2:plain": ((1, 3, 4), (0, 2))}

_saved = {}


def saved_for(case):
    if case not in _saved:
        _saved[case] = read_everything(tiny(case), PROMPT)
    return _saved[case]


def shared(model, layer):
    block = model.layers[layer]._module
    return getattr(block, model.family.shared)


@pytest.mark.parametrize("case", CASES)
def test_attention_reads_the_norm_of_the_stream_and_the_embeddings(case):
    model, saved = tiny(case), saved_for(case)
    for layer in CASES[case][0]:
        joined = torch.cat([saved[(layer, "layer_input")], saved["embeddings"]], dim=-1)
        with torch.no_grad():
            normed = shared(model, layer).input_layernorm(joined)
        assert normed.shape[-1] == 2 * model.config.hidden_size
        assert close(normed, saved[(layer, "attention_norm_output")])
        assert "concat(layer_input, embeddings)" in model.support(layer).notes["attention_norm_output"]


@pytest.mark.parametrize("case", CASES)
def test_mlp_norm_reads_the_attention_output_with_no_residual(case):
    model, saved = tiny(case), saved_for(case)
    for layer in CASES[case][0]:
        with torch.no_grad():
            normed = shared(model, layer).pre_ff_layernorm(saved[(layer, "attention_output")])
        assert close(normed, saved[(layer, "mlp_norm_output")])
        reason = model.support(layer)["layer_mid"]
        assert "no residual add" in reason and "shared attention block" in reason


@pytest.mark.parametrize("case", CASES)
def test_layer_output_is_the_mamba_layer_over_the_projected_mlp_output(case):
    model, saved = tiny(case), saved_for(case)
    for layer in CASES[case][0]:
        block = model.layers[layer]._module
        with torch.no_grad():
            projected = block.linear(saved[(layer, "mlp_output")])
            stream = saved[(layer, "layer_input")]
            inner = block.mamba_decoder
            expected = stream + inner.mamba(inner.input_layernorm(stream + projected))
        assert close(expected, saved[(layer, "layer_output")])


@pytest.mark.parametrize("case", CASES)
def test_mamba_layers_serve_the_mixer_output_and_no_mlp(case):
    model, saved = tiny(case), saved_for(case)
    for layer in CASES[case][1]:
        block = model.layers[layer]._module
        with torch.no_grad():
            mixed = block.mamba(block.input_layernorm(saved[(layer, "layer_input")]))
        assert close(mixed, saved[(layer, "attention_output")])
        assert close(saved[(layer, "layer_mid")], saved[(layer, "layer_output")])
        report = model.support(layer)
        assert "Mamba" in report["self_attn.attention_queries"]
        assert "has no MLP" in report["mlp.mlp_output"]
        assert report["self_attn.attention_output"] is None and report.notes["self_attn.attention_output"]


@pytest.mark.parametrize("case", CASES)
def test_tied_blocks_are_addressed_per_layer(case):
    model, saved = tiny(case), saved_for(case)
    first, second = CASES[case][0][:2]
    a, b = shared(model, first), shared(model, second)
    assert a is not b
    assert not close(saved[(first, "attention_queries")], saved[(second, "attention_queries")], atol=1e-3)
    # Editing one layer's shared attention leaves the earlier tied layer's values as they were, and moves the later.
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[second].self_attn.attention_head_outputs = 0
        logits = model.logits.save()
    assert not close(logits, saved["logits"], atol=1e-4)
    with torch.no_grad(), model.trace(PROMPT):
        queries = model.layers[first].self_attn.attention_queries.save()
        model.layers[second].self_attn.attention_head_outputs = 0
        premix = model.layers[second].self_attn.attention_premix.save()
    assert close(queries, saved[(first, "attention_queries")])
    assert bool((premix == 0).all())


def test_zamba_shares_one_weight_set():
    model = tiny("zamba")
    assert shared(model, 2).self_attn.q_proj.weight is shared(model, 3).self_attn.q_proj.weight
    assert "tied across the hybrid layers [2, 3]" in model.support(2).notes["self_attn.attention_output"]


def test_zamba2_cycles_its_weight_sets():
    model = tiny("zamba2")  # hybrid layers 1, 3, 4 with two weight sets: 1 and 4 share one
    assert shared(model, 1).self_attn.q_proj.weight is shared(model, 4).self_attn.q_proj.weight
    assert shared(model, 1).self_attn.q_proj.weight is not shared(model, 3).self_attn.q_proj.weight
    assert "[1, 4]" in model.support(4).notes["self_attn.attention_output"]


def heads(x, module):
    return x.view(*x.shape[:2], -1, module.head_dim).transpose(1, 2)


def test_zamba2_values_carry_each_layers_adapter():
    model, saved = tiny("zamba2"), saved_for("zamba2")
    for index, layer in enumerate(CASES["zamba2"][0]):
        attn = shared(model, layer).self_attn
        x = saved[(layer, "attention_norm_output")]
        with torch.no_grad():
            adapted = heads(attn.v_proj(x) + attn.linear_v_adapter_list[index](x), attn)
            plain = heads(attn.v_proj(x), attn)
        assert close(adapted, saved[(layer, "attention_values")])
        assert not close(plain, saved[(layer, "attention_values")], atol=1e-3)
        assert "adapter" in model.support(layer).notes["self_attn.attention_values"]
        assert "rotated" in model.support(layer).notes["self_attn.attention_queries"]


def test_zamba2_plain_queries_are_the_projection():
    model, saved = tiny("zamba2:plain"), saved_for("zamba2:plain")
    layer = 3
    attn = shared(model, layer).self_attn
    with torch.no_grad():
        queries = heads(attn.q_proj(saved[(layer, "attention_norm_output")]), attn)
    assert close(queries, saved[(layer, "attention_queries")])
    assert saved[(layer, "attention_keys")].shape[1] == 2  # grouped heads where there are no adapters
    assert "nothing is rotated" in model.support(layer).notes["self_attn.attention_queries"]


# --- decoding: the attention values of a step span the cache --------------------------------------------------------

NAMES = ("attention_queries", "attention_keys", "attention_values", "attention_scores", "attention_probabilities",
         "attention_head_outputs")


@pytest.mark.parametrize(("case", "layer"), [("zamba", 3), ("zamba2", 4), ("git", 2)])
def test_each_decode_step_sees_the_whole_cache(case, layer):
    model = tiny(case)
    attn = model.layers[layer].self_attn
    n = len(model.tokenizer(PROMPT).input_ids)
    ranks = model.order(layer)
    order = sorted(NAMES, key=lambda name: ranks[f"self_attn.{name}"])
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, do_sample=False, pad_token_id=0) as tracer:
        steps = list().save()
        for _ in tracer.iter[:3]:
            read = {name: getattr(attn, name) for name in order}  # in forward order: GIT's values follow its pattern
            steps.append(tuple(read[name] for name in NAMES))
    groups = attn.num_heads // attn.num_kv_heads
    for step, (q, k, v, scores, probs, heads) in enumerate(steps):
        rows, keys = (n, n) if step == 0 else (1, n + step)
        assert q.shape[2] == rows and k.shape[2] == keys == v.shape[2] and probs.shape[2:] == (rows, keys)
        assert close(model.family.scores(attn.heads, model.config, q, k, layer), scores)
        assert close((probs @ v.repeat_interleave(groups, dim=1)).transpose(1, 2), heads)
    assert close(steps[1][1][:, :, :-1], steps[0][1])


# --- GIT: a post-norm BERT-style decoder, on token ids alone ------------------------------------------------------

def test_git_post_norm_values():
    model, saved = tiny("git"), saved_for("git")
    inner = model._module
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        embeddings = inner.git.embeddings
        positions = embeddings.position_embeddings.weight[:len(PROMPT)]
        first = embeddings.LayerNorm(embeddings.word_embeddings(ids) + positions)
        assert close(first, saved[(0, "layer_input")])
        for layer in range(model.num_layers):
            block = inner.git.encoder.layer[layer]
            x = saved[(layer, "layer_input")]
            queries = block.attention.self.query(x).view(1, len(PROMPT), 4, 16).transpose(1, 2)
            assert close(queries, saved[(layer, "attention_queries")])
            keys = block.attention.self.key(x).view(1, len(PROMPT), 4, 16).transpose(1, 2)
            assert close(keys, saved[(layer, "attention_keys")])
            stream = block.attention.output.LayerNorm(x + saved[(layer, "attention_output")])
            assert close(stream, saved[(layer, "mlp_input")])
            assert close(block.output.LayerNorm(stream + saved[(layer, "mlp_output")]), saved[(layer, "layer_output")])
    report = model.support(1)
    for name in ("attention_norm_output", "layer_mid", "mlp_norm_output"):
        assert "normalises after each residual add" in report[name]
    assert "no final norm" in model.support()["final_norm_output"]
    assert "pixel_values" in report.notes["self_attn.attention_probabilities"]


def test_git_keys_are_written_through_their_transpose():
    model = tiny("git")
    attn = model.layers[1].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        attn.attention_keys = 0  # every visible key scores 0: each row is uniform over its visible keys
        probs = attn.attention_probabilities.save()
    rows = torch.arange(1, len(PROMPT) + 1, dtype=probs.dtype)
    assert close(probs[0, 0].sum(-1), torch.ones(len(PROMPT)))
    assert close(probs[0, :, :, 0], (1 / rows).expand(4, -1))


# --- HRM-Text: blocks run several times per forward -----------------------------------------------------------------

def hrm(h_cycles):
    import transformers

    import attnlens

    config = transformers.HrmTextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, head_dim=16, H_cycles=h_cycles, L_cycles=3,
                                        pad_token_id=0)
    torch.manual_seed(0)
    return attnlens.StandardizedTransformer(transformers.HrmTextForCausalLM(config).eval(),
                                            tokenizer=attnlens.models.char_tokenizer(), attn_implementation="eager")


def test_hrm_text_serves_the_embeddings_and_logits_and_says_why_not_the_blocks():
    model = hrm(2)
    assert model.family.name == "HrmText" and model.num_layers == 2
    assert model.support(1).available == ["embeddings", "logits"]
    reason = model.support(1)["self_attn.attention_probabilities"]
    assert "H_cycles=2 times" in reason and "H_cycles * L_cycles=6 times" in reason and "no one" in reason
    assert "final_norm" in model.support()["final_norm_output"]
    with torch.no_grad(), model.trace(PROMPT):
        embeddings, logits = model.embeddings.save(), model.logits.save()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(embeddings, model._module.model.embed_tokens(ids))
        assert close(logits, model._module(ids).logits)
    assert "once" in hrm(1).support(0)["layer_output"]


def test_git_embeddings_are_the_word_embeddings_before_positions_are_added_in_place():
    model = tiny("git")
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    inner = model._module.git.embeddings
    with torch.no_grad(), model.trace(PROMPT):
        embeddings = model.embeddings.save()
        model.embeddings = torch.zeros(1, len(PROMPT), 64)  # assignment lands: only the positions remain
        first = model.layers[0].layer_input.save()
    with torch.no_grad():
        assert torch.equal(embeddings, inner.word_embeddings(ids))
        assert close(first, inner.LayerNorm(inner.position_embeddings.weight[:len(PROMPT)])[None])


# --- BLT: the local decoder's byte-level blocks ---------------------------------------------------------------------

def test_blt_serves_the_local_decoders_blocks_over_bytes():
    model, saved = tiny("blt"), saved_for("blt")
    assert model.num_layers == 3 and saved[(0, "attention_probabilities")].shape[-1] == len(PROMPT)
    window = model.family.sliding_window(model.config, 2) or len(PROMPT)  # no window before transformers 5.24
    assert window == getattr(model.config, "local_attention_window_len", None) or window == len(PROMPT)
    last = saved[(2, "attention_probabilities")][0, :, -1]
    assert (last[:, :-window] == 0).all() and (last[:, -window:] > 0).all()
    inner = model._module.model
    with torch.no_grad():
        assert close(inner.local_decoder.norm(saved[(2, "layer_output")]), saved["final_norm_output"])
    assert "global transformer" in model.support(0).notes["layer_input"]


def test_blt_with_a_cross_attention_in_front_of_every_block():
    import attnlens

    recipe = attnlens.registered()["blt"].tiny[2]
    decoder = {**recipe["decoder_config"], "cross_attn_all_layers": True}
    model = attnlens.models.tiny("blt", decoder_config=decoder)
    crosses = model.model.local_decoder.cross_attn_layers
    with torch.no_grad(), model.trace(PROMPT):
        outputs, inputs, added = list().save(), list().save(), list().save()
        for i in range(model.num_layers):
            added.append(crosses[i].output[0].save())
            inputs.append(model.layers[i].layer_input.save())
            outputs.append(model.layers[i].layer_output.save())
    for i in range(1, model.num_layers):
        assert close(outputs[i - 1] + added[i], inputs[i])
        assert not close(outputs[i - 1], inputs[i], atol=1e-3)
    assert "cross_attn_layers[1]" in model.support(1).notes["layer_input"]
