"""GPTSw3 (attnlens/families/gpt_sw3.py): what the shared identities cannot see."""

import attnlens


def test_gpt_sw3_is_served_by_gpt2():
    from transformers import CONFIG_MAPPING

    assert CONFIG_MAPPING["gpt-sw3"]().model_type == "gpt2"
    assert isinstance(attnlens.registry.family_for("gpt-sw3"), type(attnlens.registry.family_for("gpt2")))


def test_gpt_sw3_is_served_on_vllm_with_gpt2s_locations():
    """A GPT-SW3 checkpoint's config says model type "gpt2" (GPT-2's vLLM port runs it); named as "gpt-sw3" the
    family is not refused either, and its vLLM locations are GPT-2's."""
    sw3, gpt2 = attnlens.registry.family_for("gpt-sw3"), attnlens.registry.family_for("gpt2")
    assert sw3.vllm.refused(sw3, "gpt-sw3") is None and sw3.vllm.refused(sw3, "gpt2") is None
    assert sw3.vllm.locations(sw3) == gpt2.vllm.locations(gpt2)
