"""The same checks and the same typed errors on vLLM as on the transformers engine (tests/test_errors.py): writes
checked against the layout, copies that refuse in-place edits, attnlens's errors raised as themselves in the client."""

import pytest
import torch

import attnlens
from attnlens.models import char_tokenizer, tiny_model

LAYER = 1


def traced(model, prompt, edit, steps=1):
    """Run `edit(attn, step)` on each step of a greedy generation, returning the last logits."""
    attn = model.layers[LAYER].self_attn
    with torch.no_grad(), model.generate(prompt, max_new_tokens=steps, do_sample=False) as tracer:
        logits = list().save()
        for step in tracer.iter[:steps]:
            edit(attn, step)
            logits.append(model.logits[:, -1].clone())
    return logits[-1]


# --- writes are checked against the layout with this run's sizes ------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "name", "layout", "got", "hint"),
    [
        (
            lambda attn, step: setattr(attn, "attention_head_outputs", attn.attention_head_outputs.transpose(1, 2)),
            "attention_head_outputs",
            "[batch=1, seq=18, num_heads=4, head_dim=32]",
            "[1, 4, 18, 32]",
            "looks like [batch, num_heads, seq, head_dim]",
        ),
        (
            lambda attn, step: setattr(attn, "attention_head_outputs", attn.attention_head_outputs[0]),
            "attention_head_outputs",
            "[batch=1, seq=18, num_heads=4, head_dim=32]",
            "[18, 4, 32]",
            "no batch axis",
        ),
        (
            lambda attn, step: setattr(attn, "attention_head_outputs", torch.zeros(1, 18, 128)),
            "attention_head_outputs",
            "[batch=1, seq=18, num_heads=4, head_dim=32]",
            "[1, 18, 128]",
            "unflatten",
        ),
        (
            lambda attn, step: setattr(attn, "attention_keys", attn.attention_keys.repeat_interleave(2, dim=1)),
            "attention_keys",
            "[batch=1, num_kv_heads=2, seq=18, qk_head_dim=32]",
            "[1, 4, 18, 32]",
            "groups its 4 query heads over 2 key/value heads",
        ),
    ],
    ids=["heads first", "no batch axis", "merged heads", "keys per query head"],
)
def test_a_write_of_another_shape_names_value_layout_and_shape(llama, edit, name, layout, got, hint):
    with pytest.raises(attnlens.EditError) as error:
        traced(llama.vllm, llama.prompt, edit)
    message = str(error.value)
    assert message.startswith(f"layers[{LAYER}].self_attn.{name} expects a tensor of layout {layout}; got shape {got}")
    assert hint in message


def test_numbers_and_same_shape_tensors_are_written_the_same_as_on_eager(llama):
    def zero(attn, step):
        attn.attention_head_outputs = 0

    on_vllm, on_eager = (traced(model, llama.prompt, zero) for model in (llama.vllm, llama.eager))
    assert torch.allclose(on_vllm, on_eager, atol=1e-4)


# --- copies refuse in-place edits ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "name", "why"),
    [
        (lambda attn, step: attn.attention_output.zero_(), "self_attn.attention_output", "it is a copy"),
        (
            lambda attn, step: attn.attention_keys.zero_() if step == 1 else None,
            "self_attn.attention_keys",
            "on a decode step it is a new tensor",
        ),
    ],
    ids=["attention output", "decode-step keys"],
)
def test_an_in_place_edit_of_a_copy_is_refused(llama, edit, name, why):
    with pytest.raises(
        attnlens.EditError,
        match=rf"layers\[1\].{name} was edited in place, but on Llama \(vllm\) "
        rf"{why}.*Assign it instead",
    ):
        traced(llama.vllm, llama.prompt, edit, steps=2)


def test_an_in_place_edit_of_the_residual_sum_is_refused(llama):
    model = llama.vllm
    with pytest.raises(attnlens.EditError, match=r"layers\[1\].layer_input was edited in place.*\(hidden, residual\)"):
        with torch.no_grad(), model.trace(llama.prompt, temperature=0.0):
            model.layers[LAYER].layer_input.mul_(0)


def test_an_assigned_edit_of_a_copy_lands(llama):
    clean = traced(llama.vllm, llama.prompt, lambda attn, step: None)

    def edit(attn, step):
        out = attn.attention_output
        out[:] = 0
        attn.attention_output = out

    assert not torch.allclose(traced(llama.vllm, llama.prompt, edit), clean)


# --- errors raised in vLLM's worker come back as themselves -----------------------------------------------------


def test_unavailable_order_and_index_errors_are_typed(llama):
    model = llama.vllm
    with pytest.raises(attnlens.Unavailable, match=r"layers\[1\].mlp.mlp_activation on Llama \(vllm\): vLLM fuses"):
        with model.trace(llama.prompt, temperature=0.0):
            model.layers[LAYER].mlp.mlp_activation.save()
    with pytest.raises(
        attnlens.OrderError,
        match=r"layers\[1\].self_attn.attention_queries was read after "
        r"layers\[1\].self_attn.attention_output",
    ):
        with model.trace(llama.prompt, temperature=0.0):
            model.layers[LAYER].self_attn.attention_output.save()
            model.layers[LAYER].self_attn.attention_queries.save()
    with pytest.raises(IndexError, match=r"layer 3 is out of range: this model has 3 layers"):
        model.layers[3]
    with pytest.raises(IndexError, match=r"layer -4 is out of range"):
        model.support(-4)
    assert model.support(-1).layer == 2 and model.order(-1) == model.order(2)


@pytest.mark.parametrize("name", ["self_attn.attention_probabilities", "layer_input", "mlp.mlp_output"])
def test_a_value_read_or_written_outside_a_trace_says_to_read_it_inside_one(llama, name):
    """The same words as on eager (tests/test_errors.py), on both engines of the same weights."""
    host, _, value = name.rpartition(".")
    said = []
    for model in (llama.vllm, llama.eager):
        envoy = model.layers[LAYER] if not host else getattr(model.layers[LAYER], host)
        with pytest.raises(attnlens.OutsideTrace, match=r"is read inside a trace, while the forward runs") as read:
            getattr(envoy, value)
        with pytest.raises(attnlens.OutsideTrace, match=r"is written inside a trace") as written:
            setattr(envoy, value, torch.zeros(1))
        said += [str(read.value), str(written.value)]
    assert said[:2] == said[2:]


def test_a_wrong_family_fact_is_a_location_drift_at_load(tmp_path):
    tiny_model("gemma2", head_dim=32).save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(attnlens.LocationDrift, match="sliding window is 8 but vLLM's kernel uses 4"):
        attnlens.StandardizedVLLM(
            str(tmp_path),
            family=WideWindow,
            dtype="float32",
            max_model_len=64,
            distributed_executor_backend="uni",
            kv_cache_memory_bytes=8 * 2**20,
        )


class WideWindow(attnlens.family_for("gemma2").__class__):
    """Gemma 2 with a sliding window vLLM's kernel does not use."""

    class ScoreFunction(attnlens.ScoreFunction):
        def sliding_window(self, config, layer):
            return 8 if super().sliding_window(config, layer) else None


# --- loading and input --------------------------------------------------------------------------------------------


def test_empty_prompts_and_misspelled_values_read_as_on_eager(llama):
    model = llama.vllm
    with pytest.raises(ValueError, match="the prompt is an empty string"):
        with model.trace("", temperature=0.0):
            model.logits.save()
    with pytest.raises(AttributeError, match=r"Did you mean model.layers\[i\].self_attn.attention_probabilities"):
        getattr(model.layers[LAYER].self_attn, "attention_probs")  # noqa: B009  the misspelling under test
    with pytest.raises(ValueError, match="the list of layers is empty"):
        attnlens.capture_attention(model, llama.prompt, [])


def test_family_by_name_and_torch_dtype_are_accepted(llama):
    model = attnlens.StandardizedVLLM(
        str(llama.path),
        family="llama",
        torch_dtype="float32",
        max_model_len=64,
        distributed_executor_backend="uni",
        kv_cache_memory_bytes=8 * 2**20,
    )
    assert model.family.name == "Llama" and model.support(1)["self_attn.attention_probabilities"] is None
    with pytest.raises(attnlens.UnknownFamily, match=r"'lama'.*registered: "):
        attnlens.StandardizedVLLM(str(llama.path), family="lama")
