"""The encoder-decoders built as T5 is (attnlens/families/t5_like.py), on their own arithmetic: Switch Transformers'
top-1 router recomputed by hand and a re-routed token's output moving the logits as a hook on plain transformers
predicts; Pop2Piano's encoder reading its features (a composer's embedding first, under generate)."""

import warnings

import pytest
import torch

import attnlens

SOURCE = torch.tensor([[5, 6, 7, 8, 9, 10]])
TARGET = torch.tensor([[2, 11, 12, 13]])
_models: dict = {}


def tiny(model_type: str) -> attnlens.StandardizedSeq2Seq:
    if model_type not in _models:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _models[model_type] = attnlens.models.tiny_seq2seq(model_type)
    return _models[model_type]


def routed(sparse, x: torch.Tensor, rank: int = 0) -> torch.Tensor:
    """Each token of `x` [seq, hidden] through its `rank`-th best expert of `sparse` (a SwitchTransformersSparseMLP),
    times that expert's router probability: the sparse feed-forward by hand (rank 0, within the capacity)."""
    probabilities = (x @ sparse.router.classifier.weight.T).softmax(-1)
    chosen = probabilities.topk(rank + 1, dim=-1).indices[:, rank]
    return torch.stack(
        [probabilities[t, e] * sparse.experts[f"expert_{int(e)}"](x[t]) for t, e in enumerate(chosen)]
    ), chosen


def test_switch_routes_each_token_to_its_best_expert_as_recomputed_by_hand():
    model = tiny("switch_transformers")
    block = model.encoder.layers[1]
    with torch.no_grad(), model.trace(input_ids=SOURCE, decoder_input_ids=TARGET):
        x = block.mlp_input.save()
        out = block.mlp.mlp_output.save()
    sparse = block._module.layer[1].mlp
    with torch.no_grad():
        expected, chosen = routed(sparse, x[0])
    assert torch.allclose(out[0], expected, atol=1e-6)
    assert len(set(chosen.tolist())) > 1, "the tokens go to several experts"
    # block 0 keeps T5's dense feed-forward; block 1 (every encoder_sparse_step-th from 1) is sparse
    assert model.encoder.support(0)["mlp.mlp_neurons"] is None
    assert "sparse mixture of experts" in model.encoder.support(1)["mlp.mlp_neurons"]
    assert "sparse mixture of experts" in model.decoder.support(1)["mlp.mlp_activation"]


def test_a_token_sent_to_its_second_expert_moves_the_logits_as_a_hook_predicts():
    """mlp_output of the encoder's sparse block with token 2 re-routed to its second-best expert (by hand, from the
    served mlp_input) equals re-routing it inside transformers' SparseMLP by a hook on its output."""
    model = tiny("switch_transformers")
    block = model.encoder.layers[1]
    sparse = block._module.layer[1].mlp
    with torch.no_grad(), model.trace(input_ids=SOURCE, decoder_input_ids=TARGET):
        x = block.mlp_input.save()
        out = block.mlp.mlp_output.save()
        plain = model.logits.save()
    with torch.no_grad():
        second, _ = routed(sparse, x[0], rank=1)
    rerouted = out.clone()
    rerouted[0, 2] = second[2]
    with torch.no_grad(), model.trace(input_ids=SOURCE, decoder_input_ids=TARGET):
        block.mlp.mlp_output = rerouted
        moved = model.logits.save()

    def reroute(module, args, output):
        output = output.clone()
        output[0, 2] = routed(module, args[0][0], rank=1)[0][2]
        return output

    handle = sparse.register_forward_hook(reroute)
    try:
        with torch.no_grad():
            expected = model._module(input_ids=SOURCE, decoder_input_ids=TARGET).logits
    finally:
        handle.remove()
    assert torch.allclose(moved, expected, atol=1e-5)
    assert not torch.allclose(moved, plain, atol=1e-4)


def test_pop2pianos_encoder_reads_the_composer_then_the_features_and_serves_no_embeddings():
    model = tiny("pop2piano")
    hf = model._module
    features = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), model.generate(input_features=features, max_new_tokens=1) as tracer:
        first = model.encoder.layers[0].layer_input.save()
        tracer.result.save()
    composer = hf.generation_config.composer_to_feature_token["composer1"]
    offset = min(hf.generation_config.composer_to_feature_token.values())
    assert first.shape == (1, 7, 64)
    assert torch.equal(first[0, 0], hf.mel_conditioner.embedding.weight[composer - offset])
    assert torch.equal(first[0, 1:], features[0])
    assert "input_features" in model.encoder.support(0)["embeddings"]
    with pytest.raises(attnlens.Unavailable, match="embed_tokens never runs"):
        with model.trace(input_features=features, decoder_input_ids=TARGET):
            model.encoder.embeddings.save()
