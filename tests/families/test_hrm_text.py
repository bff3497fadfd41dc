"""HrmText (attnlens/families/hrm_text.py): what the shared identities cannot see."""

import torch
from conftest import PROMPT
from identities import close


def hrm(h_cycles):
    import transformers

    import attnlens

    config = transformers.HrmTextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        H_cycles=h_cycles,
        L_cycles=3,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return attnlens.StandardizedTransformer(
        transformers.HrmTextForCausalLM(config).eval(),
        tokenizer=attnlens.models.char_tokenizer(),
        attn_implementation="eager",
    )


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
