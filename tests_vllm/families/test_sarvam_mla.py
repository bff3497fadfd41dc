"""Sarvam-MLA on vLLM: refused before an engine starts, because neither vLLM nor the transformers it pins has a
config class for sarvam_mla."""

import json
import re

import pytest
import transformers

import attnlens


def test_vllm_cannot_read_a_sarvam_mla_config_as_the_refusal_says(tmp_path):
    """transformers here has no SarvamMLAConfig, so the config is DeepSeek-V3's, saved under Sarvam's model type and
    vLLM's architecture (what SarvamMLAConfig writes besides is the same DeepSeek-V3 fields); vLLM's own config
    reading refuses it in the words the family quotes (a vLLM that reads it fails here: check the family's
    locations, which are DeepSeek-V3's, and serve it), and StandardizedVLLM refuses it before an engine starts."""
    from vllm.config import ModelConfig

    assert not hasattr(transformers, "SarvamMLAConfig")
    family = attnlens.registered()["sarvam_mla"]()
    transformers.DeepseekV3Config(**family.tiny[2]).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "model_type": "sarvam_mla", "architectures": ["SarvamMLAForCausalLM"]})
    )
    quoted = re.search(r'"(.+?)"', family.vllm.refusal).group(1)
    with pytest.raises(Exception, match=re.escape(quoted)):
        ModelConfig(model=str(tmp_path))
    with pytest.raises(attnlens.UnknownFamily, match=re.escape(quoted)):
        attnlens.StandardizedVLLM(str(tmp_path))
