"""Blt (attnlens/families/blt.py): what the shared identities cannot see."""

import torch
from conftest import PROMPT, tiny
from identities import close, saved_for


def test_blt_serves_the_local_decoders_blocks_over_bytes():
    model, saved = tiny("blt"), saved_for("blt")
    assert model.num_layers == 3 and saved[(0, "attention_probabilities")].shape[-1] == len(PROMPT)
    window = model.family.score_function().sliding_window(model.config, 2) or len(
        PROMPT
    )  # no window before transformers 5.24
    assert window == getattr(model.config, "local_attention_window_len", None) or window == len(PROMPT)
    last = saved[(2, "attention_probabilities")][0, :, -1]
    assert (last[:, :-window] == 0).all() and (last[:, -window:] > 0).all()
    inner = model._module.model
    with torch.no_grad():
        assert close(inner.local_decoder.norm(saved[(2, "layer_output")]), saved["final_norm_output"])
    assert "global transformer" in model.support(0).notes["layer_input"]


def test_blt_with_a_cross_attention_in_front_of_every_block():
    import attnlens

    recipe = attnlens.registered()["blt"].tiny[2]
    decoder = {**recipe["decoder_config"], "cross_attn_all_layers": True}
    model = attnlens.models.tiny("blt", decoder_config=decoder)
    crosses = model.model.local_decoder.cross_attn_layers
    with torch.no_grad(), model.trace(PROMPT):
        outputs, inputs, added = list().save(), list().save(), list().save()
        for i in range(model.num_layers):
            added.append(crosses[i].output[0].save())
            inputs.append(model.layers[i].layer_input.save())
            outputs.append(model.layers[i].layer_output.save())
    for i in range(1, model.num_layers):
        assert close(outputs[i - 1] + added[i], inputs[i])
        assert not close(outputs[i - 1], inputs[i], atol=1e-3)
    assert "cross_attn_layers[1]" in model.support(1).notes["layer_input"]
