"""NanoChat (attnlens/families/nanochat.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import close, saved_for


def test_nanochat_final_norm_is_the_second_run():
    model, saved = tiny("nanochat"), saved_for("nanochat")
    inner = model._module
    with torch.no_grad():
        assert close(inner.model.norm(saved[(2, "layer_output")]), saved["final_norm_output"])
        assert close(inner.model.norm(saved["embeddings"]), saved[(0, "layer_input")])
