"""CTRL (attnlens/families/ctrl.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import saved_for

import attnlens


def test_ctrl_embeddings_are_a_snapshot_before_the_in_place_scaling():
    model, saved = tiny("ctrl"), saved_for("ctrl")
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(saved["embeddings"], model._module.transformer.w(ids))
    with pytest.raises(attnlens.EditError):
        with torch.no_grad(), model.trace(PROMPT):
            model.embeddings[:] = 0
