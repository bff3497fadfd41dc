"""GPTNeoX (attnlens/families/gpt_neox.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import LAYER, at, attention_module, close, read_everything

import attnlens
from attnlens.models import char_tokenizer, tiny_model


def test_gpt_neox_parallel_mlp_norm_reads_the_block_input():
    # Fresh LayerNorms are the identity's affine (weight 1, bias 0), which would make the two norms indistinguishable.
    inner = tiny_model("gpt_neox", seed=1)
    with torch.no_grad():
        for norm in (m for m in inner.modules() if isinstance(m, torch.nn.LayerNorm)):
            norm.weight.normal_(1, 0.5), norm.bias.normal_(0, 0.5)
    model = attnlens.StandardizedTransformer(inner, tokenizer=char_tokenizer())
    saved = read_everything(model, PROMPT)
    block = inner.gpt_neox.layers[LAYER]
    norm_output = saved[(LAYER, "mlp_norm_output")]
    with torch.no_grad():
        assert close(block.post_attention_layernorm(saved[(LAYER, "layer_input")]), norm_output)
    assert not close(norm_output, saved[(LAYER, "attention_norm_output")])
    sequential = tiny("gpt_neox:sequential").layers[LAYER]._module
    assert close(
        sequential.post_attention_layernorm(at("gpt_neox:sequential", "layer_mid")),
        at("gpt_neox:sequential", "mlp_norm_output"),
    )


@pytest.mark.parametrize("case", ["gpt_neox", "gpt_neox:sequential"])
def test_gpt_neox_per_head_fused_split(case):
    module = attention_module(case)
    d = module.head_size
    with torch.no_grad():
        x = at(case, "attention_norm_output")
        q, k, v = module.query_key_value(x).view(*x.shape[:2], -1, 3 * d).transpose(1, 2).chunk(3, dim=-1)
    r = module.rotary_ndims
    assert torch.equal(at(case, "attention_values"), v)
    assert close(at(case, "attention_keys")[..., r:], k[..., r:])
    assert close(at(case, "attention_queries")[..., r:], q[..., r:])
