"""Git (attnlens/families/git.py): what the shared identities cannot see."""

import torch
from conftest import PROMPT, tiny
from identities import close, saved_for


def test_git_post_norm_values():
    model, saved = tiny("git"), saved_for("git")
    inner = model._module
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        embeddings = inner.git.embeddings
        positions = embeddings.position_embeddings.weight[: len(PROMPT)]
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
        assert close(first, inner.LayerNorm(inner.position_embeddings.weight[: len(PROMPT)])[None])
