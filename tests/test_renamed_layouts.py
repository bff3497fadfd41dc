"""Families whose blocks are the common arithmetic under other names: the score function, bit for bit with padding.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, trace

from attnlens.models import char_tokenizer

#: Families whose score function is more than the common one (own masks, own order of mask and scale) or whose queries
#: and keys are read from an unusual place; each with a layer that has softmax attention.
SCORES = {
    "openai-gpt": 1,
    "codegen": 1,
    "dbrx": 1,
    "persimmon": 1,
    "ctrl": 1,
    "diffllama": 1,
    "granite_swa": 0,
    "laguna": 1,
    "jamba": 1,
    "recurrent_gemma": 1,
    "nemotron_h": 2,
    "falcon_h1": 1,
    "flint": 1,
    "beam": 1,
    "minimax": 0,
    "moshi": 1,
    "olmo_hybrid": 1,
    "modernbert-decoder": 0,
    "xglm": 1,
    "trocr": 1,
}


@pytest.mark.parametrize("case", SCORES)
def test_score_function_is_exact_with_padding(case):
    model, layer = tiny(case), SCORES[case]
    tokenizer = char_tokenizer()
    tokenizer.padding_side = "left"
    batch = tokenizer([PROMPT, "Hi there"], return_tensors="pt", padding=True)
    assert not batch.attention_mask.all()

    def read(model):
        attn = model.layers[layer].self_attn
        return {"q": attn.attention_queries, "k": attn.attention_keys, "s": attn.attention_scores}

    got = trace(model, read, dict(batch))
    heads = model.layers[layer].self_attn.heads
    rebuilt = model.family.score_function().scores(
        heads, model.config, got["q"], got["k"], layer, key_mask=batch.attention_mask
    )
    real = batch.attention_mask.bool()[:, None, :, None]  # queries at padding positions see nothing real
    assert close(torch.where(real, rebuilt, 0), torch.where(real, got["s"], 0))
