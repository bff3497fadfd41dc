"""Checks on what a run is given, made before anything runs and the same on both engines."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def check_inputs(inputs: tuple, kwargs: dict | None = None) -> None:
    """Refuse an empty prompt, an empty list of prompts or a prompt of no tokens, saying which."""
    for prompt in inputs:
        _check(prompt)
    for name in ("input_ids", "prompt_token_ids"):
        if kwargs and name in kwargs:
            _check(kwargs[name])


def _check(prompt: Any) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is an empty string: a forward needs at least one token")
    elif isinstance(prompt, Mapping):
        if "input_ids" in prompt:
            _check(prompt["input_ids"])
        elif "prompt_token_ids" in prompt:
            _check(prompt["prompt_token_ids"])
    elif isinstance(prompt, torch.Tensor):
        if prompt.numel() == 0:
            raise ValueError(
                f"the prompt's token ids are empty (shape {list(prompt.shape)}): a forward needs at least one token"
            )
    elif isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError("the list of prompts is empty: pass at least one prompt (a string or token ids)")
        if not all(isinstance(token, int) for token in prompt):
            for each in prompt:
                _check(each)


def check_layers(layers: Any) -> list:
    """A layer argument as a list: one int or a non-empty sequence of them."""
    if isinstance(layers, int) and not isinstance(layers, bool):
        return [layers]
    layers = list(layers)
    if not layers:
        raise ValueError("the list of layers is empty: name at least one layer (an int, or a list of ints)")
    return layers
