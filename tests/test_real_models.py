"""The bundled real checkpoints: generation is right, and every layer's pattern is transformers' own."""

import pytest
import torch
from identities import failures, read_everything

import attnlens

#: on one worker under pytest-xdist (`--dist loadgroup`), so each checkpoint is loaded once
pytestmark = [pytest.mark.real, pytest.mark.xdist_group("real_checkpoints")]


@pytest.fixture(scope="module")
def smollm2():
    return attnlens.models.smollm2()


@pytest.fixture(scope="module")
def gemma3():
    return attnlens.models.gemma3_270m()


def greedy(model, prompt, tokens):
    with torch.no_grad(), model.generate(prompt, max_new_tokens=tokens, do_sample=False) as tracer:
        result = tracer.result.save()
    return model.tokenizer.decode(result[0, len(model.tokenizer(prompt).input_ids) :])


def patterns_match_output_attentions(model, prompt):
    layers = model.num_layers
    with torch.no_grad(), model.trace(prompt):
        ours = list().save()
        for layer in model.layers:
            ours.append(layer.self_attn.attention_probabilities)
    ids = model.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        theirs = model._module(**ids, output_attentions=True).attentions
    assert len(theirs) == layers
    return [i for i in range(layers) if not torch.allclose(ours[i], theirs[i], atol=1e-6)]


def test_smollm2_knows_the_capital_of_france(smollm2):
    assert greedy(smollm2, "The capital of France is", 1) == " Paris"


def test_smollm2_patterns_are_transformers_own(smollm2):
    attn = smollm2.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (9, 3, 64)
    assert patterns_match_output_attentions(smollm2, "The capital of France is Paris, and of Italy") == []


@pytest.mark.parametrize("layer", [0, 15, 29])
def test_smollm2_identities(smollm2, layer):
    saved = read_everything(smollm2, "The Eiffel Tower is in the city of")
    assert failures(smollm2, saved, layer) == []


def test_gemma3_270m_patterns_past_its_window(gemma3):
    window = gemma3.config.sliding_window
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 60)
    n = len(gemma3.tokenizer(prompt).input_ids)
    assert n > window  # the sliding layers really slide
    assert patterns_match_output_attentions(gemma3, prompt) == []


def test_gemma3_270m_generates_and_holds_the_identities(gemma3):
    attn = gemma3.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (4, 1, 256)
    # The 270M base model is no quiz champion; what matters is that tracing changes nothing transformers decides.
    prompt = "The capital of France is"
    ids = gemma3.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        plain = gemma3._module.generate(**ids, max_new_tokens=5, do_sample=False)
    assert greedy(gemma3, prompt, 5) == gemma3.tokenizer.decode(plain[0, ids.input_ids.shape[1] :])
    saved = read_everything(gemma3, "The Eiffel Tower is in the city of")
    assert failures(gemma3, saved, 0) == [] and failures(gemma3, saved, 5) == []


def test_conversions_at_once_each_end_with_the_whole_folder(tmp_path):
    """Two processes converting one checkpoint at once into an empty cache (two workers on a fresh machine) both end
    with the complete folder; the second to finish finds the first's and discards its own copy (they once wrote one
    shared `.partial` folder, and the second rename failed: "Directory not empty")."""
    import os
    import subprocess
    import sys

    convert = "import attnlens; print(attnlens.models.smollm2_path())"
    env = {**os.environ, "ATTNLENS_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", convert], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [(run.wait(timeout=600), *run.communicate()) for run in runs]
    assert [(status, out.strip()) for status, out, _ in results] == [
        (0, str(tmp_path / "smollm2-135m-instruct"))
    ] * 2, [err[-2000:] for _, _, err in results]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m-instruct"]  # no partial copy left
    assert (tmp_path / "smollm2-135m-instruct" / "model.safetensors").exists()
