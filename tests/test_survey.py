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
    pytest.skip(
        f"the survey covers transformers {DATA['versions']['transformers']} and "
        f"{other.get('versions', {}).get('transformers')}, not {transformers.__version__}"
    )


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


def test_the_json_is_the_data_dumped():
    assert survey.JSON_PATH.read_text() == survey.dump(DATA), "regenerate: python -m tools.survey"


def test_an_update_replaces_only_the_types_surveyed_in_their_order(monkeypatch):
    """`python -m tools.survey --update`: the fresh records of the types asked for replace theirs, on both
    transformers, in the mapping's order; the other records stay as committed; mixed versions are refused."""
    from tools.survey import __main__ as command

    def record(model_type, mark):
        return {"model_type": model_type, "build": {"ok": True, "seconds": 0.0, "error": None}, "mark": mark}

    data = {
        "versions": {"transformers": "1"},
        "other": {"versions": {"transformers": "0"}, "records": {"a": {"mark": "old"}, "b": {"mark": "old"}}},
        "records": {t: record(t, "old") for t in "abc"},
    }
    monkeypatch.setattr(command, "installed", lambda: {"versions": {"transformers": "1"}, "types": ["a", "b", "c"]})
    monkeypatch.setattr(command, "survey", lambda types, jobs=2: {t: record(t, "new") for t in types})
    monkeypatch.setattr(
        command,
        "_other",
        lambda python, types=None: {
            "versions": {"transformers": "0"},
            "types": ["b", "a"],
            "records": {t: {"mark": "new"} for t in types if t in ("a", "b")},
        },
    )
    updated = command.update(data, ["c", "a"], "python")
    assert list(updated["records"]) == ["a", "b", "c"]
    assert {t: r["mark"] for t, r in updated["records"].items()} == {"a": "new", "b": "old", "c": "new"}
    assert updated["other"] == {
        "versions": {"transformers": "0"},
        "records": {"b": {"mark": "old"}, "a": {"mark": "new"}},
    }
    assert data["records"]["a"]["mark"] == "old"  # the committed data is not changed in place
    with pytest.raises(SystemExit, match="not causal-LM types"):
        command.update(data, ["zzz"], "python")
    monkeypatch.setattr(command, "installed", lambda: {"versions": {"transformers": "2"}, "types": ["a"]})
    with pytest.raises(SystemExit, match="run the whole survey"):
        command.update(data, ["a"], "python")
