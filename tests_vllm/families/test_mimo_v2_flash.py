"""MiMo-V2-Flash on vLLM: refused before an engine starts."""

import pytest

import attnlens


def test_mimo_v2_flash_is_refused_before_an_engine_starts(tmp_path):
    model = attnlens.models.tiny_model("mimo_v2_flash")
    model.config.save_pretrained(tmp_path)
    with pytest.raises(attnlens.UnknownFamily, match="hybrid_layer_pattern"):
        attnlens.StandardizedVLLM(str(tmp_path))
