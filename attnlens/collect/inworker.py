"""Features reduced at vLLM's attention op, in its worker (attnlens/vllm/reducer.py): which taps a collection needs.

On a `StandardizedVLLM`, features that read only the attention kernel's arguments (queries, keys, values) are
computed by `attnlens.vllm.reducer` with the traced path's own code (`features.features_of`), on plain requests, a
whole batch per `generate` call; `collect` builds its engine with those layers' static taps (`points_for`), so it
runs at vLLM's defaults (compiled, prefix caching, chunked prefill). Features whose values are not tapped at the
attention op (head outputs: `head_output_norm`, and `head_attribution`, which reads the final residual) keep the
traced path, on an engine built eagerly.
"""

from __future__ import annotations

import functools

from ..values import KERNEL_VALUES


def servable(features) -> bool:
    """Whether every feature reads only values tapped at the attention op."""
    return all(name in KERNEL_VALUES for feature in features for name in feature.reads)


def shorts_of(features) -> list[str]:
    """The static taps a collection of `features` needs on a layer: queries and keys always (the reducer scores
    them), values where a feature reads them."""
    wanted = {"attention_queries", "attention_keys", *(name for f in features for name in f.reads)}
    return [short for name, short in KERNEL_VALUES.items() if name in wanted]


def compute(features, options: dict, wants: dict):
    """What the reducer computes on a prompt's run of layers: the features' columns (`features.features_of`)."""
    from .features import features_of

    return functools.partial(features_of, features=features, options=options, wants=wants)


def points_for(features, layers=None):
    """`static_points` for `StandardizedVLLM` (`features`: names or `Feature`s): a function of the model (family
    and config known, engine not built) naming the taps of `shorts_of(features)` on each of `layers` (default: every
    layer whose attention op taps them all)."""
    from ..vllm import static
    from .features import resolve

    features = [
        resolve(f)[0] if isinstance(f, str) else f for f in ([features] if isinstance(features, str) else features)
    ]
    shorts = shorts_of(features)

    def names(model) -> list[str]:
        chosen = range(model.num_layers) if layers is None else ([layers] if isinstance(layers, int) else layers)
        found = []
        for layer in chosen:
            layer = model.access.check_layer(layer)
            taps = static.taps(model.family, model.text_config, layer)
            if layers is not None or all(taps.get(short) == "kernel" for short in shorts):
                found += [f"{short}.{layer}" for short in shorts]  # a named layer without them raises in declare
        return found

    return names


def untapped(model, features, layer: int) -> list[str]:
    """The kernel arguments `features` read on `layer` that vLLM's attention kernel does not receive as attnlens
    serves them (`attnlens.vllm.reducer.untapped`)."""
    from ..vllm import reducer

    return reducer.untapped(model, layer, shorts_of(features))
