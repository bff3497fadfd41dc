"""The committed survey (docs/survey.json, docs/survey.md) against the installed transformers and the code."""

import json

import pytest
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import attnlens
from tools import survey

DATA = json.loads(survey.JSON_PATH.read_text())
#: One of each kind: the common layout, a fused projection, attention-free, a hybrid, an encoder run as a decoder.
RESURVEYED = ("llama", "gpt2", "mamba", "jamba", "bert")


def _records_here() -> dict:
    """The committed records of the installed transformers (full, or the other version's compact ones)."""
    if transformers.__version__ == DATA["versions"]["transformers"]:
        return DATA["records"]
    other = DATA.get("other") or {}
    if other.get("versions", {}).get("transformers") == transformers.__version__:
        return other["records"]
    pytest.skip(f"the survey covers transformers {DATA['versions']['transformers']} and "
                f"{other.get('versions', {}).get('transformers')}, not {transformers.__version__}")


def test_every_causal_lm_type_is_surveyed():
    assert list(_records_here()) == list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def test_page_is_the_data_rendered():
    assert survey.MARKDOWN_PATH.read_text() == survey.render(DATA), "regenerate: python -m tools.survey --render"


def test_registered_types_are_current():
    registered = {t for t in attnlens.registered() if t in DATA["records"]}
    assert {t for t, r in DATA["records"].items() if r["registered"]} == registered


@pytest.mark.parametrize("model_type", RESURVEYED)
def test_resurvey_matches_record(model_type):
    committed = _records_here()[model_type]
    record = json.loads(json.dumps(survey.survey_type(model_type), default=str))  # as committed: JSON's keys
    if isinstance(committed["build"], bool):  # the other transformers' compact record
        assert survey.compact(record) == committed
        return
    for key in ("build", "layout", "layers", "layers_path", "kinds", "causal", "encoder_style", "registered"):
        expected, found = committed.get(key), record.get(key)
        if key == "build":
            expected, found = expected["ok"], found["ok"]
        assert found == expected, key
    assert (record.get("serves") or {}).get("check") == (committed.get("serves") or {}).get("check")
    common, found = committed.get("common_layout"), record.get("common_layout")
    if common is not None:
        for key in ("differences", "features", "check", "dropped", "fits"):
            assert found[key] == common[key], key
