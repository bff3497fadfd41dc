"""GPTSw3 (attnlens/families/gpt_sw3.py): what the shared identities cannot see."""

import attnlens


def test_gpt_sw3_is_served_by_gpt2():
    from transformers import CONFIG_MAPPING

    assert CONFIG_MAPPING["gpt-sw3"]().model_type == "gpt2"
    assert isinstance(attnlens.registry.family_for("gpt-sw3"), type(attnlens.registry.family_for("gpt2")))
