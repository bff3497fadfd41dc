"""The `attention` fields of a served request and response, as pydantic models (beside vLLM's own protocol models).

A request to `/v1/completions` or `/v1/chat/completions` may carry `attention` (`AttentionRequest`: what the `openai`
client sends with `extra_body={"attention": {...}}`); the response then carries `attention`, a list beside `choices`
with one `ChoiceAttention` per choice (matched by `index`); a streamed response carries, in each chunk, the numbers of
the rows reduced since the chunk before (and the rest before `[DONE]`). `GET /v1/attention/schema` serves these
models' JSON Schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..row_features import FEATURES


class Span(BaseModel):
    """One span of `span_mass`: a token range of the prompt, a character range of the prompt (a completion's one
    prompt, or a chat's prompt as its template renders it), or a chat message (its content's characters). Ranges are
    [start, end), end exclusive."""

    model_config = ConfigDict(extra="forbid")

    tokens: tuple[int, int] | None = None
    chars: tuple[int, int] | None = None
    message: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _one_kind(self) -> Span:
        given = [name for name in ("tokens", "chars", "message") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"a span names exactly one of tokens, chars or message; got {given or 'none'}")
        for name in ("tokens", "chars"):
            found = getattr(self, name)
            if found is not None and not 0 <= found[0] < found[1]:
                raise ValueError(
                    f"{name} [{found[0]}, {found[1]}) is empty or negative: give [start, end), start < end"
                )
        return self


class AttentionRequest(BaseModel):
    """What a request asks of the attention of the rows it runs."""

    model_config = ConfigDict(extra="forbid")

    features: list[str] = Field(
        min_length=1, description=f"features to compute per layer, head and row: {', '.join(FEATURES)}"
    )
    layers: list[int] | None = Field(
        None, description="layers (negative from the last); default every layer the server serves"
    )
    heads: list[int] | None = Field(None, description="query heads; default every head")
    rows: Literal["generated", "prompt", "all"] = Field(
        "generated",
        description="generated: the row that produced each generated token (the prompt's last, then one per decode "
        "step); prompt: every prompt position; all: both",
    )
    top_k: int = Field(5, ge=1, le=64, description="keys per row of top_keys")
    spans: list[Span] = Field(default_factory=list, description="spans of span_mass")
    encoding: Literal["json", "base64"] = Field(
        "json", description="json: nested lists; base64: each array's little-endian bytes, with shape and dtype"
    )
    dtype: Literal["float32", "float16"] = Field("float32", description="dtype of base64 float arrays")

    @model_validator(mode="after")
    def _known(self) -> AttentionRequest:
        unknown = [name for name in self.features if name not in FEATURES]
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown}; known: {', '.join(FEATURES)}")
        if "span_mass" in self.features and not self.spans:
            raise ValueError("span_mass needs spans: give attention.spans, e.g. [{'tokens': [0, 8]}]")
        return self


class AttentionArray(BaseModel):
    """One array: its shape (layers, heads, rows, then the feature's own axis if any), dtype and data (nested lists,
    or base64 of its little-endian bytes)."""

    shape: list[int]
    dtype: str
    data: list | str


class ChoiceAttention(BaseModel):
    """The numbers of one choice (`index`, as in `choices`): on `layers` x `heads` x the rows at `positions`."""

    index: int
    layers: list[int]
    heads: list[int]
    positions: list[int] = Field(description="each row's position: prompt tokens first, then generated ones")
    prompt_tokens: int
    spans: list[tuple[int, int]] = Field(default_factory=list, description="span_mass's spans as token ranges")
    arrays: dict[str, AttentionArray] = Field(default_factory=dict)
    error: str | None = Field(None, description="why this choice's numbers could not be computed, if so")


def schema() -> dict:
    return {"request": AttentionRequest.model_json_schema(), "response": ChoiceAttention.model_json_schema()}
