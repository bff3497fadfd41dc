"""GraniteMoeShared (attnlens/families/granitemoeshared.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import close, saved_for


def test_granitemoeshared_mlp_output_is_the_sum_no_module_returns():
    model, saved = tiny("granitemoeshared"), saved_for("granitemoeshared")
    assert model.support(0)["mlp.mlp_output"].startswith("the MLP's output is block_sparse_moe's output plus")
    block = model.layers[0]._module
    with torch.no_grad():
        x = saved[(0, "mlp_input")]
        update = (block.block_sparse_moe(x) + block.shared_mlp(x)) * block.residual_multiplier
    assert close(saved[(0, "layer_mid")] + update, saved[(0, "layer_output")])
