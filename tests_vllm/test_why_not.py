"""On vLLM as on eager (tests/test_why_not.py): on each kind of layer of every family the vLLM backend serves, every
value `support()` reports unavailable raises `attnlens.Unavailable` with exactly that reason when read inside a trace,
in vLLM's worker, where the reads run."""

from attnlens.values import ALL_VALUES, SUBLAYER_OF


def test_every_unserved_value_raises_its_reason(models):
    model = models.vllm
    first: dict = {}
    for layer in range(model.num_layers):  # the first layer of each distinct report stands for its kind
        first.setdefault(tuple(model.support(layer).reasons.items()), layer)
    layers = list(first.values())
    asked = [(None, "model", v.attribute, model.support(layers[0])[v.key]) for v in ALL_VALUES if v.scope == "model"]
    asked += [
        (layer, v.scope, v.attribute, model.support(layer)[v.key])
        for layer in layers
        for v in ALL_VALUES
        if v.scope != "model"
    ]
    asked = [entry for entry in asked if entry[3] is not None]
    with model.trace(models.prompt, temperature=0.0):
        raised = list().save()
        for layer, scope, name, _ in asked:
            try:
                target = model if layer is None else model.layers[layer]
                if scope in SUBLAYER_OF:  # a decoder-only block's `cross_attn` stands in, raising the reason
                    target = getattr(target, SUBLAYER_OF[scope])
                getattr(target, name)
                raised.append(None)
            except Exception as error:  # noqa: BLE001  (recorded: every wrong outcome is reported at once)
                raised.append((type(error).__name__, str(error)))
    wrong = [
        f"{name}@{layer}: support() says {reason!r}; the read gave {outcome}"
        for (layer, _, name, reason), outcome in zip(asked, raised, strict=True)
        if outcome is None or outcome[0] != "Unavailable" or not outcome[1].endswith(f": {reason}")
    ]
    assert not wrong, "\n".join(wrong)
