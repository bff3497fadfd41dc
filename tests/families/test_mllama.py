"""Mllama (attnlens/families/mllama.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import saved_for


def test_mllama_skips_cross_attention_blocks_on_text():
    model, saved = tiny("mllama_text_model"), saved_for("mllama_text_model")
    assert model.config.cross_attention_layers == [1]
    reason = model.support(1)["layer_input"]
    assert reason.startswith("layer 1 of Mllama is a cross-attention block")
    served = [key for key, reason in model.support(1).reasons.items() if reason is None]
    assert served == [] or set(served) <= {"embeddings", "final_norm_output", "logits"}  # the model's own values
    assert torch.equal(saved[(0, "layer_output")], saved[(2, "layer_input")])  # the stream passes the skipped block
