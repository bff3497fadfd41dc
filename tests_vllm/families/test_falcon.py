"""Falcon on vLLM: its other layouts (sequential blocks, the new decoder architecture) against eager; the default
layout is test_equal_to_eager's."""

import pytest
import test_equal_to_eager as equal
from conftest import layout


@pytest.fixture(scope="session", params=["falcon:multihead", "falcon:new_architecture"])
def falcon(request, tmp_path_factory):
    """The sequential block (its residual is added in place on vLLM) and the new decoder architecture (grouped
    key/value heads, two norms); the default layout (multi-query, parallel) is test_equal_to_eager's."""
    return layout(request.param, tmp_path_factory)


def test_falcon_layouts_equal_eager(falcon):
    equal.test_every_value_equals_eager_on_prefill_and_decode_steps(falcon)
    equal.test_identities_hold_on_vllms_own_tensors_every_step(falcon)
    equal.test_greedy_tokens_equal_transformers(falcon)
