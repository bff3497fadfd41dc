"""Layers that reuse an earlier layer's keys and values (Gemma 4's last `num_kv_shared_layers`; vLLM calls their
kernel as `attn(q, None, None)`): on vLLM's own tensors they attend with exactly the source layer's keys and values,
on the prefill and decode steps; they are read-only there; the source is checked against vLLM's kernel at load.
(tests_vllm/test_equal_to_eager.py compares every value of these layers with the eager engine's.)"""

import pytest
import torch
from conftest import pair

import attnlens
from attnlens.families.gemma4 import Gemma4Text
from attnlens.vllm import shared_kv


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return pair("gemma4_text", tmp_path_factory)


def shared_layers(model):
    return {
        layer: Gemma4Text.shared_from(model.text_config, layer)
        for layer in range(model.num_layers)
        if Gemma4Text.shared_from(model.text_config, layer) is not None
    }


def test_a_shared_layer_attends_with_its_source_layers_keys_and_values_every_step(gemma4):
    model, shared = gemma4.vllm, shared_layers(gemma4.vllm)
    assert shared == {2: 0, 3: 1}  # the checkpoint's two layer types, each shared once
    with torch.no_grad(), model.generate(gemma4.prompt, max_new_tokens=3, do_sample=False) as tracer:
        steps = list().save()
        for _ in tracer.iter[:3]:
            steps.append(
                {
                    (i, name): getattr(model.layers[i].self_attn, name).clone()
                    for i in {*shared, *shared.values()}
                    for name in ("attention_keys", "attention_values")
                }
            )
    for step, values in enumerate(steps):
        for layer, source in shared.items():
            for name in ("attention_keys", "attention_values"):
                assert torch.equal(values[layer, name], values[source, name]), (step, layer, name)
        assert values[2, "attention_keys"].shape[2] == len(gemma4.eager.tokenizer(gemma4.prompt).input_ids) + step


def test_a_shared_layers_keys_are_read_only_and_support_says_whose_they_are(gemma4):
    model = gemma4.vllm
    with pytest.raises(attnlens.EditError, match="computes no keys or values"):
        with torch.no_grad(), model.trace(gemma4.prompt):
            model.layers[3].self_attn.attention_keys = model.layers[3].self_attn.attention_keys * 0
    notes = model.support(3).notes
    assert "reused from layer 1" in notes["self_attn.attention_keys"]
    assert "attn(q, None, None)" in notes["self_attn.attention_values"]


def test_a_family_that_disagrees_with_vllm_about_the_source_fails_at_load(gemma4):
    class Kernel(torch.nn.Module):
        kv_sharing_target_layer_name = "model.layers.0.self_attn.attn"

    family, config = Gemma4Text(), gemma4.vllm.text_config
    assert shared_kv.check(family, config, 2, Kernel()) == 0
    with pytest.raises(attnlens.LocationDrift, match="layer 3: the family says the layer attends with layer 1's"):
        shared_kv.check(family, config, 3, Kernel())
    with pytest.raises(attnlens.LocationDrift, match="attends with its own keys"):
        shared_kv.check(family, config, 0, Kernel())


def test_a_shared_layer_has_no_static_taps_of_its_keys_or_pattern(gemma4):
    """Its kernel receives `attn(q, None, None)`: no tap at the attention op holds its keys, values or a pattern
    rebuilt from them (they would be None there), so declaring one is refused before an engine is built; its
    queries are tapped, and a layer computing its own keys has every kernel tap."""
    from attnlens.vllm import static

    model, shared = gemma4.vllm, shared_layers(gemma4.vllm)
    family, config = model.family, model.text_config
    for layer in shared:
        assert set(static.taps(family, config, layer)) & {"key", "value", "attn_scores", "attn_probs"} == set()
        assert static.taps(family, config, layer)["query"] == "kernel"
        with pytest.raises(attnlens.Unavailable, match="not a static tap on vLLM"):
            attnlens.StandardizedVLLM(str(gemma4.path), static_points=[f"attn_probs.{layer}"])
    own = next(layer for layer in range(model.num_layers) if layer not in shared)
    assert {"query", "key", "value", "attn_probs"} <= set(static.taps(family, config, own))
