"""ALiBi on vLLM (Bloom, Falcon's ALiBi layout): the kernel's slopes are the family's, and the pattern served is the
kernel's arithmetic.

Generic over the mechanism; a family's own tests are in tests_vllm/families/test_<family>.py."""

import test_equal_to_eager as equal
import torch
from conftest import PROMPT, layout, pair


def kernel_slopes(model) -> list:
    """The ALiBi slopes of each layer's attention kernel in vLLM's worker (None without ALiBi)."""
    family = model.family

    def slopes(vllm_model):
        layers = vllm_model.get_submodule(family.layers)
        return [layer.get_submodule(f"{family.attention}.{family.vllm.kernel}").impl.alibi_slopes for layer in layers]

    return model.vllm_entrypoint.apply_model(slopes)[0]


def test_falcon_alibi_is_vllms_own_arithmetic(tmp_path_factory):
    """vLLM adds Falcon's ALiBi once, with float32 slopes times 1/sqrt(d), where transformers' eager attention adds
    it twice with bfloat16 slopes: on vLLM the pattern served is the vLLM kernel's (its @ values is the head outputs
    on every step), and the eager arithmetic on the same tensors is not."""

    models = layout("falcon:alibi", tmp_path_factory)
    model, family = models.vllm, models.vllm.family
    assert torch.equal(kernel_slopes(model)[0], family.score_function("vllm").alibi_slopes(model.text_config, 0))
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, do_sample=False) as tracer:
        steps = list().save()
        for _ in tracer.iter[:3]:
            attn = model.layers[1].self_attn
            steps.append(
                [
                    attn.attention_queries.clone(),
                    attn.attention_keys.clone(),
                    attn.attention_values.clone(),
                    attn.attention_probabilities.clone(),
                    attn.attention_head_outputs.clone(),
                ]
            )
    heads = model.layers[1].self_attn.heads
    for queries, keys, values, pattern, outputs in steps:
        values = values.repeat_interleave(heads.groups, dim=1)
        assert equal.close((pattern @ values).transpose(1, 2), outputs)
        assert equal.close(
            family.score_function("vllm").scores(heads, model.text_config, queries, keys, 1).softmax(-1), pattern
        )
        eager_pattern = (
            family.score_function("transformers").scores(heads, model.text_config, queries, keys, 1).softmax(-1)
        )
        assert not equal.close((eager_pattern @ values).transpose(1, 2), outputs)


def test_bloom_kernel_adds_the_familys_alibi_slopes(tmp_path_factory):
    models = pair("bloom", tmp_path_factory)
    for layer, slopes in enumerate(kernel_slopes(models.vllm)):
        assert torch.equal(
            slopes, models.vllm.family.score_function("vllm").alibi_slopes(models.vllm.text_config, layer)
        )
