"""EXAONE 3 on vLLM: refused in vLLM's words while the transformers vLLM pins cannot read its config."""

import json
import re

import pytest

import attnlens


def test_vllm_cannot_read_an_exaone_config_as_its_refusal_says(tmp_path):
    """vLLM's model config raises the words the refusal quotes on an `exaone` checkpoint (a vLLM that reads it fails
    here: check vLLM's ExaoneForCausalLM against the family and serve it), and StandardizedVLLM refuses before an
    engine starts. The transformers here (5.19) has no ExaoneConfig to save one: the config is written as transformers
    5.24 saves the tiny checkpoint, which builds it as LlamaForCausalLM."""
    from vllm.config import ModelConfig

    config = {**attnlens.family.TINY_DEFAULTS, "model_type": "exaone", "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    family = attnlens.registered()["exaone"]()
    quoted = re.search(r'"(.+?)"', family.vllm.refusal).group(1)
    with pytest.raises(Exception, match=re.escape(quoted)):
        ModelConfig(model=str(tmp_path))
    with pytest.raises(attnlens.UnknownFamily, match=re.escape(quoted)):
        attnlens.StandardizedVLLM(str(tmp_path))
