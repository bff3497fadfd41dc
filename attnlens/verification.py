"""A family checked against the model it loads, before anything is served.

- `resolve(model)`: the list of blocks, and on the first block of each kind every module a served
  value is read at and the head sizes, found in the model; one that is not there raises `Miswired` naming the
  family's member, where the path broke and what is there instead.
- `verify(model)`: one forward on a few tokens reading every served value of the first block of each kind and of the
  last block; each value's layout is checked against the sizes (docs/values.md), the identities of `attnlens.checks`
  run, and the unembedding of the final norm's output is checked against the logits. What fails raises `Miswired`
  naming each identity, what was expected and found, and the family's members to check.

`StandardizedTransformer` resolves every family, and verifies on a forward a family attnlens does not ship (one a
user registers or passes, one inferred from the model's structure) or, asked (`verify=True`), a built-in one;
`verify=False` skips the forward.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from nnsight.intervention.envoy import Envoy

from .applications import GatheredBlock, gathered_blocks
from .checks import Checks, batch_and_length, failures, read_everything
from .errors import AttnlensError, Miswired
from .family import MODULE_PATHS, final_softcap, token_embeddings
from .locations import Location, child
from .parts.identities import overrides
from .values import BY_NAME, SUBLAYER_OF

#: The axes of a layout read off the attention's head sizes (`Sizes`): a layer serving a value laid out along one of
#: them has heads to read (a mixer layer, a Mamba layer has none).
HEAD_AXES = {"num_heads", "num_kv_heads", "head_dim", "qk_head_dim", "num_heads*head_dim"}

#: Tokens in the verifying forward: enough for a pattern with masked and visible entries in every row but the first.
TOKENS = 6

#: What to check where an identity fails: (words in its name, the family's members that state what it reads).
HINTS = (
    ("queries shape", "sizes.num_heads, sizes.qk_head_dim, and where attention_queries is read"),
    ("keys shape", "sizes.num_kv_heads, sizes.qk_head_dim, and where attention_keys is read"),
    ("values shape", "sizes.num_kv_heads, sizes.head_dim, and where attention_values is read"),
    ("head outputs shape", "sizes.num_heads, sizes.head_dim, and where attention_head_outputs is read"),
    ("shape", "the sizes, and where the value is read"),
    ("layout", "the sizes (the head sizes, config.hidden_size), and where the value is read"),
    (
        "rows sum to one",
        "where attention_probabilities is read (the softmax's output), or a sink the family does not read",
    ),
    ("entries", "where attention_probabilities is read, and the score function's mask and sliding_window"),
    ("softmax(scores)", "where attention_scores is read: what enters the softmax, after the mask"),
    ("sink", "where attention_sinks is read"),
    (
        "score function",
        "sizes.scale and the ScoreFunction's steps, or where attention_queries and attention_keys are read",
    ),
    ("probabilities @ values", "where attention_values and attention_head_outputs are read"),
    (
        "merged head outputs",
        "output_projection (attention_premix is its input), or an output gate it does not read (attention_gate)",
    ),
    ("output projection", "output_projection, and where attention_output is read"),
    ("layer input + attention", "mlp_norm (layer_mid is its input), attention_post_norm, or Identities.residual_add"),
    ("mlp norm", "mlp_norm"),
    ("mlp input", "mlp and mlp_norm"),
    ("mlp(mlp input)", "mlp, or Identities.mlp_forward"),
    ("layer mid + mlp", "mlp, mlp_post_norm, or Identities.residual_add"),
    (
        "next layer input",
        "layers, where layer_output is read, and added_between_blocks where the model adds features between blocks",
    ),
    ("unembedding", "final_norm (final_norm_output is its output)"),
    ("", "activation, down_projection, or Identities.mlp_arithmetic"),  # the MLP's arithmetic, named by the family
)


def _hint(identity: str) -> str:
    return next(hint for words, hint in HINTS if words in identity)


def _where(root: torch.nn.Module, module: torch.nn.Module) -> str:
    name = next((name for name, found in root.named_modules() if found is module), "")
    return name or "the model"


def _described(root: torch.nn.Module, module: torch.nn.Module) -> str:
    """`module` as a message names it: its path, its class and its children's names."""
    children = ", ".join(name for name, _ in module.named_children()) or "none"
    return f"{_where(root, module)} ({type(module).__name__}; its modules: {children})"


def _find(root: torch.nn.Module, host: Any, path: str, family, member: str) -> Any:
    """The envoy at the dotted `path` below the envoy `host` (as a read reaches it: `locations.child`), or `Miswired`
    naming `member` and the modules where the path broke."""
    found = host
    for part in filter(None, path.split(".")):
        try:
            found = child(found, part)
        except (AttributeError, IndexError, TypeError):
            raise Miswired(
                f"family {family.name}: {member} names no module of {_where(root, host._module)}: "
                f"{_described(root, found._module)} has no module {part!r}. "
                f"Check the family's {member.split(' = ')[0].split(' (')[0]}."
            ) from None
    return found


def _member(family, path: str, value: str) -> str:
    """The family members that name `path` (`attention_norm, mlp_norm = 'norm1'`), or the value whose location does."""
    members = [member for member in MODULE_PATHS if getattr(family, member, None) == path]
    return f"{', '.join(members)} = {path!r}" if members else f"the location of {value} (module {path!r})"


def _module_of(location: Location) -> str | None:
    """The module path a location reads at (through derived values), or None where it names none."""
    while isinstance(getattr(location, "source", None), Location) or isinstance(
        getattr(location, "keys", None), Location
    ):
        location = getattr(location, "source", None) or location.keys
    return getattr(location, "module", None)


def blocks(root: torch.nn.Module, family) -> torch.nn.ModuleList | torch.nn.Sequential | list[GatheredBlock]:
    """The family's list of blocks in `root` (where its blocks are parallel lists of modules, XLM's, the gathered
    blocks: `applications.gathered_blocks`), or `Miswired` saying what `layers` names instead."""
    gathered = gathered_blocks(root, family)
    if gathered is not None:
        return gathered
    found = _find(root, root, family.layers, family, f"layers = {family.layers!r}")
    if not isinstance(found, (torch.nn.ModuleList, torch.nn.Sequential)):
        lists = [f"{name} ({len(m)})" for name, m in root.named_modules() if isinstance(m, torch.nn.ModuleList)]
        raise Miswired(
            f"family {family.name}: layers = {family.layers!r} names a {type(found).__name__}, not a list of blocks "
            f"(the lists in the model: {', '.join(lists) or 'none'}). Check the family's layers."
        )
    return found


def representatives(family, config, layers) -> list[int]:
    """The first block of each kind: of its class and its attention's, and of its `Family.layer_kind` (blocks of one
    kind share their locations and code, so what holds on the first holds on the others)."""
    firsts: dict[tuple, int] = {}
    for layer, block in enumerate(layers):
        try:
            attention = type(block.get_submodule(family.path("attention")))
        except AttributeError:
            attention = None
        firsts.setdefault((type(block), attention, family.layer_kind(config, layer)), layer)
    return sorted(firsts.values())


def resolve(model) -> None:
    """Every module, size and operation `model`'s family names, found in it on the first block of each kind (through
    the envoys a read goes through, so nnsight's renames apply; operations: `Anchored.verify`)."""
    root, family, config = model._module, model.family, model.config
    for layer in representatives(family, config, blocks(root, family)):
        block = model.layers[layer]
        hosts = {"model": model, "layer": block}
        served = family.locations_for(config, layer)
        for value, location in served.items():
            scope = BY_NAME[value].scope if value in BY_NAME else "attention"
            if scope not in hosts:  # a sublayer (attention, cross-attention, MLP), found once a value is read on it
                role, standard = scope, SUBLAYER_OF[scope]
                hosts[scope] = getattr(block, standard, None)
                if not isinstance(hosts[scope], Envoy):  # nothing renamed to it: the path is not there
                    raise Miswired(
                        f"family {family.name}: {role} = {family.path(role)!r} names no module of block {layer}, "
                        f"{_described(root, block._module)}, where the family reads the {role}'s values. Check the "
                        f"family's {role}, or its layer_kind and kind_locations where blocks differ."
                    )
            path = _module_of(location)
            if path:
                _find(root, hosts[scope], path, family, _member(family, path, value))
        attention = hosts["attention"]._module if "attention" in hosts else None
        if attention is None and "cross_attention" in hosts:  # a block with a cross-attention alone (Mllama's)
            attention = hosts["cross_attention"]._module
        if any(HEAD_AXES & set(BY_NAME[value].axes) for value in served if value in BY_NAME):
            sizes(family, attention)
        family.verify(root, layer, block._module, attention)  # its operations, in the module's code


def sizes(family, attention: torch.nn.Module):
    """The heads of `attention` as the family's `sizes` read them, or `Miswired` naming the size and what is there."""
    try:
        return family.sizes.geometry(attention, family)
    except AttributeError as error:
        numbers = {
            name: value
            for name, value in vars(attention).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not name.startswith("_")
        }
        there = ", ".join(f"{name}={value:g}" for name, value in numbers.items()) or "none"
        raise Miswired(
            f"family {family.name}: {error} (the numbers it holds: {there}). Check the family's sizes "
            f"(attnlens.Sizes: attribute paths on the attention module, numbers, or functions of the module)."
        ) from error


def hidden_size(root: torch.nn.Module, family) -> int:
    """The width of the residual stream: the text config's `hidden_size`, else the input embeddings' width (a config
    that names it otherwise)."""
    config = root.config.get_text_config(decoder=True) if hasattr(root.config, "get_text_config") else root.config
    width = getattr(config, "hidden_size", None)
    if width is not None:
        return width
    return input_embeddings(root, family).weight.shape[-1]


def input_embeddings(root: torch.nn.Module, family) -> torch.nn.Module:
    """The module that embeds the tokens: the family's `embed_tokens`, else the model's (`token_embeddings`)."""
    if family.embed_tokens:
        try:
            return root.get_submodule(family.embed_tokens)
        except AttributeError:
            pass
    return token_embeddings(root)


def layout_failures(model, saved: dict, layers: list[int]) -> list[str]:
    """Each served value whose shape differs from its layout (docs/values.md) at the model's sizes."""
    root, family = model._module, model.family
    batch, length = batch_and_length(saved, layers[0])
    config = model.config.get_text_config(decoder=True)
    common = {"batch": batch, "seq": length, "query": length, "key": length, "hidden": hidden_size(root, family)}
    head = root.get_output_embeddings()  # a classifier's logits are over its labels: checked where it unembeds
    if getattr(head, "weight", None) is not None and getattr(config, "vocab_size", None):
        common["vocab"] = config.vocab_size
    streams = overrides(family, "residual_read")  # the norms read several streams collapsed
    check = Checks()
    for key, tensor in saved.items():
        layer, name = key if isinstance(key, tuple) else (None, key)
        if name not in BY_NAME or not torch.is_tensor(tensor) or name.startswith("attention_cache"):
            continue
        if name == "logits" and "vocab" not in common:  # a classifier's, over its labels: as its caller gets them
            continue
        known = dict(common)
        if name == "embeddings":  # the token embedding's own width (ELECTRA's embedding_size, projected after it)
            known["hidden"] = input_embeddings(root, family).weight.shape[-1]
        if layer is not None and model.support(layer)["self_attn.attention_queries"] is None:
            heads = model.access.geometry(layer)
            known.update(
                num_heads=heads.num_heads,
                num_kv_heads=heads.num_kv_heads,
                head_dim=heads.head_dim,
                qk_head_dim=heads.qk_head_dim,
            )
            known["num_heads*head_dim"] = heads.num_heads * heads.head_dim
        axes = BY_NAME[name].axes
        if name == "attention_premix" and overrides(family, "merge_heads"):
            continue  # the family merges its heads otherwise (DiffLlama's pairs): the premix's width is its own
        if streams and axes == ["batch", "seq", "hidden"] and tensor.dim() == 4:
            axes = ["batch", "seq", "streams", "hidden"]  # several residual streams (hyper-connections)
        where = "" if layer is None else f"layer {layer}, "
        expected = tuple(known.get(axis, found) for axis, found in zip(axes, tensor.shape))
        if len(axes) != tensor.dim():
            expected = tuple(axes)
        check(f"{where}{name} layout [{' '.join(axes)}]", expected, tensor.shape)
    return list(check)


def head_between(root: torch.nn.Module, family) -> str | None:
    """Why the output embedding does not read the final norm's output directly: a module with weights of its own beside
    the blocks and the output embedding (ModernBERT's prediction head); None where there is none."""
    output = root.get_output_embeddings()
    layers = root.get_submodule(family.layers)
    for name, module in root.named_children():
        if module is output or any(m is layers for m in module.modules()) or next(module.parameters(), None) is None:
            continue
        return (
            f"{name} ({type(module).__name__}) sits between the final norm and the unembedding, so the logits are "
            f"no linear read-out of final_norm_output"
        )
    return None


def unembedding_failures(model, saved: dict) -> list[str]:
    """Whether the logits are the model's output embedding of `final_norm_output`, soft-capped where the config caps
    them, up to one positive factor (a logit scale: Cohere's, Granite's); not checked where a module with weights of
    its own sits between them (`head_between`)."""
    head = model._module.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if "final_norm_output" not in saved or weight is None or weight.dim() != 2:
        return []
    if head_between(model._module, model.family) is not None:
        return []
    if "logits" not in saved:
        return []
    x, logits = saved["final_norm_output"], saved["logits"]
    expected = None
    if x.shape[-1] == weight.shape[1]:
        expected = torch.nn.functional.linear(x.to(weight.dtype), weight, getattr(head, "bias", None)).float()
        cap = final_softcap(model)
        if cap:
            expected = torch.tanh(expected / cap) * cap
        elif expected.shape == logits.shape:
            scale = (expected * logits.float()).sum() / (expected * expected).sum().clamp_min(1e-30)
            expected = expected * scale if scale > 0 else expected
    check = Checks()
    check("logits == unembedding(final norm output), up to a logit scale", expected, logits)
    return list(check)


def _suspects(family, config, saved: dict, error: str) -> str:
    """Where the value an out-of-order read names, and the one read before it, are read (the family's members)."""
    named = re.search(r"(?:layers\[(\d+)\]\.)?(?:self_attn\.|mlp\.)?(\w+) was requested", error)
    reads = [key if isinstance(key, tuple) else (None, key) for key in saved if key != "logits"]
    if named:
        reads.append((int(named.group(1)) if named.group(1) else None, named.group(2)))
    said = []
    for layer, value in reads[-2:][::-1]:
        location = family.locations_for(config, layer).get(value)
        path = _module_of(location) if location is not None else None
        said.append(f"{value} ({_member(family, path, value) if path else f'the location of {value}'})")
    return " and ".join(said) or "the family's locations()"


def verify(model) -> None:
    """One forward on `TOKENS` tokens: the layouts and identities of the first block of each kind and of the last one,
    and the unembedding; `Miswired` listing what fails. In eval mode: the wiring is checked, not dropout (a model
    built in training mode is left so)."""
    training = {module: module.training for module in model._module.modules()}
    model._module.eval()
    try:
        _verify(model)
    finally:
        for module, mode in training.items():
            module.training = mode


def _verify(model) -> None:
    family, config = model.family, model.config
    layers = sorted({*representatives(family, config, blocks(model._module, family)), model.num_layers - 1})
    vocab = getattr(config.get_text_config(decoder=True), "vocab_size", None) or 16
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), vocab, (1, TOKENS), generator=generator)
    saved: dict = {}
    try:
        read_everything(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, layers, saved)
    except AttnlensError as error:
        raise Miswired(
            f"family {family.name}: {error}, on the forward at load that reads every served value in order(). A "
            f"value listed in locations() out of forward order, or a module path naming a module that runs "
            f"elsewhere in the forward, does this: check {_suspects(family, config, saved, str(error))}."
        ) from error
    shapes = layout_failures(model, saved, layers)
    found = [
        f"{failed}: {failed.detail}; check {_hint(failed)}" for failed in [*shapes, *unembedding_failures(model, saved)]
    ]
    for layer in layers:  # a shape the layouts found wrong is said once
        found += [
            f"layer {layer}, {failed}: {failed.detail}; check {_hint(failed)}"
            for failed in failures(model, saved, layer)
        ]
    if found:
        lines = "\n  - ".join(found)
        raise Miswired(
            f"family {family.name} does not compute what it states on this model (one forward of {TOKENS} tokens "
            f"at load, layers {', '.join(map(str, layers))}):\n  - {lines}\nServed, these values would be wrong. "
            f"Fix the family (docs/extending.md), or load with verify=False to serve it unverified."
        )
