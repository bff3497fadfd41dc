"""The common layout, inferred and verified on a model of a type attnlens has no family for.

Many model types in transformers are the common layout (`attnlens.Family`, Llama's) under another name. When a model
of an unregistered type loads, `Inferred(model)` finds its names from its structure and the source of its forwards
(the block list, the embeddings, the final norm, and in each block the norms, the attention and the MLP as the block's
forward uses them), then checks, statically and before anything is served, that the blocks compute what the common
layout reads: each check in `CHECKS`, in order. Where every check passes it is a family like any other (the full
vocabulary, sparse-MoE layers as `SparseMoE` does them); where one fails it raises `NotCommonLayout` naming that check,
and the model falls back to `UnknownLayout`. A missing activation, down projection or final norm drops only its value.
"""

from __future__ import annotations

import ast
import functools
import json
import sys
from collections.abc import Callable

import torch

from .errors import AttnlensError, LocationDrift
from .family import INTERFACE_CALL, Family, block_list, token_embeddings
from .parts import scoring
from .parts.moe import SparseMoE, moe_absent
from .parts.source import compiled, operation_lines
from .values import BY_NAME, of_scope

#: Keywords the interface call may pass besides the tensors: none changes what the eager function computes (the
#: mask carries the window; position ids only mark packed sequences for flash attention).
INTERFACE_KEYWORDS = ("dropout", "scaling", "sliding_window", "position_ids")
#: What is checked, in the order it is checked: check name -> what must hold. The first that fails is reported.
CHECKS = {
    "blocks": "a ModuleList of the text config's num_hidden_layers blocks (the decoder's where there are several)",
    "embeddings": "the input embeddings (get_input_embeddings()) are a module of the model",
    "model_forward": "the module holding the blocks builds transformers' causal masks (create_causal_mask, "
    "create_sliding_window_causal_mask) and runs the blocks in one loop, each block's output the "
    "next one's input",
    "block_forward": "each block's forward is h = x + [post_norm](mixer(norm(x))), then h + [post_norm](mlp(norm(h))), "
    "read from its source (dropout aside)",
    "attention_module": "the mixer of at least one block calls the shared attention interface "
    "(ALL_ATTENTION_FUNCTIONS)",
    "same_names": "every block uses the same norm, MLP and attention names (a hybrid's other mixer aside)",
    "mask": "each attention layer is full or sliding-window causal attention (config.layer_types), and a window "
    "read from the config is one the model builds a mask for",
    "interface_call": f"the call is `{INTERFACE_CALL}(self, query, key, value, attention_mask, ...)` with "
    f"scaling=self.scaling, and no keyword beyond {', '.join(INTERFACE_KEYWORDS)} and **kwargs",
    "output_path": "the interface's output reaches the output projection only merged (reshape, view, contiguous), "
    "and the projection's output is the attention's output (dropout aside): no gate, norm or scale",
    "anchors": "every operation the family reads passes the load-time check (`Family.verify`): the masked scores "
    "and the pattern at their anchors in the eager function",
    "eager_function": "the eager function is the model module's `eager_attention_forward`, operation for operation "
    "the common one (Llama's): scale, mask, softmax, dropout, no soft-cap, no sinks",
    "sizes": "num_heads, num_kv_heads, head_dim, scaling and num_key_value_groups read off the attention module and "
    "its config, consistent with the projections' widths",
}
#: Methods that only merge heads or lay a tensor out in memory, between the interface's output and the projection.
MERGES = ("reshape", "view", "contiguous")
#: The layer types the common mask covers (config.layer_types).
MASKED = ("full_attention", "sliding_attention")
#: The functions transformers builds those masks with (masking_utils).
MASK_FUNCTIONS = ("create_causal_mask", "create_sliding_window_causal_mask")
#: What a hybrid's other mixers (no softmax attention) do not serve: the attention's values but its output.
ATTENTION_VALUES = frozenset(of_scope("attention")) - {"attention_output"}


def _text(config):
    """The config the language model reads: a composite config's text (decoder) config, a text config itself."""
    return config.get_text_config(decoder=True) if config is not None else None


class NotCommonLayout(AttnlensError):
    """A model that is not the common layout: `check` names the first check of `CHECKS` that failed."""

    def __init__(self, check: str, detail: str):
        super().__init__(f"{check}: {detail}")
        self.check, self.detail = check, detail


def _refuse(check: str, detail: str):
    raise NotCommonLayout(check, detail)


# --- reading a forward's source ------------------------------------------------------------------------------------


def _forward_tree(function: Callable) -> tuple[Callable, ast.FunctionDef]:
    innermost, code = compiled(function)
    tree = ast.parse(code.source)
    return innermost, next(node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def blocks_run_once(model: torch.nn.Module, layers: str) -> str | None:
    """Why the blocks at `layers` may not run exactly once per forward, in order (None: the forward of the module
    holding them iterates them in one loop). A block that runs twice (a looped section) has no one input and output."""
    parent_path, _, attribute = layers.rpartition(".")
    parent = model.get_submodule(parent_path)
    try:
        _, tree = _forward_tree(type(parent).forward)
    except Exception:  # noqa: BLE001  (no source: nothing can be said either way)
        return None
    loops = [
        node for node in ast.walk(tree) if isinstance(node, ast.For) and f"self.{attribute}" in ast.unparse(node.iter)
    ]
    outer = [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.For, ast.While))
        and node not in loops
        and any(inner in loops for inner in ast.walk(node))
    ]
    if len(loops) == 1 and not outer:
        return None
    where = f"in {len(loops)} loops" if len(loops) != 1 else "in a loop inside another"
    return (
        f"{type(parent).__name__}.forward runs self.{attribute} {where}: a block may run more than once per "
        f"forward, or out of order, so it has no one input and output"
    )


#: Module names of a decoder's cross-attention (what reads an encoder's output).
CROSS_ATTENTION = ("encoder_attn", "cross_attn", "cross_attention", "crossattention")


def not_a_plain_decoder(model: torch.nn.Module) -> str | None:
    """What kind of model this is where it is not a decoder of token ids with attention (None: it may be one)."""
    config = model.config
    cross = next((name for name, _ in model.named_modules() if name.rpartition(".")[2] in CROSS_ATTENTION), None)
    if getattr(config, "is_encoder_decoder", False) or cross:  # MusicGen's decoder runs alone, with its own config
        return (
            "the decoder of an encoder-decoder model: its cross-attention reads the encoder's output, which token "
            "ids alone do not give"
        )
    if any(flag in config.to_dict() for flag in ("is_decoder", "causal")):
        return (
            "an encoder (BERT-style) that runs as a decoder only with its decoder flag "
            f"(is_decoder={getattr(config, 'is_decoder', None)}): its blocks are not a decoder's"
        )
    if not any(
        "attention" in type(module).__name__.lower() or "attn" in type(module).__name__.lower()
        for module in model.modules()
    ):
        return (
            "attention-free: no module of it is an attention module (a state-space or recurrent mixer), so there "
            "are no queries, keys or pattern"
        )
    return None


#: The forwards `layouts` looks at: 2 prompts of 5 token ids, then of 7 (sizes no tiny model's hidden size or head
#: count takes); two lengths tell positions added to the prompt's from streams stacked along it.
LAYOUT_PROMPTS, LAYOUT_TOKENS = 2, (5, 7)


def layouts(model: torch.nn.Module, family) -> dict[str, str]:
    """Value name -> how its tensor differs from the `[batch, seq, ...]` of docs/values.md, for the values an
    `UnknownLayout` serves, seen on two small forwards at load (none where all agree). A model attnlens does not know
    may run its blocks sequence-first (XLNet), add positions of its own (CPM-Ant's prompt) or stack several streams
    along the sequence (ProphetNet's n-gram streams)."""
    served = family.locations()
    seen: dict[str, list[tuple[int, ...]]] = {}  # this forward's shapes (one per block for the block values)

    def keep(name, value):
        value = value[0] if isinstance(value, (tuple, list)) and value else value
        if isinstance(value, torch.Tensor):
            seen.setdefault(name, []).append(tuple(value.shape))

    handles = []
    if "embeddings" in served:
        embeddings = model.get_submodule(family.embed_tokens)
        handles.append(embeddings.register_forward_hook(lambda module, args, output: keep("embeddings", output)))
    if "layer_input" in served:
        for block in model.get_submodule(family.layers):  # as ModuleInput reads: the first argument, else keyword
            handles.append(
                block.register_forward_pre_hook(
                    lambda module, args, kwargs: keep(
                        "layer_input", args[0] if args else next(iter(kwargs.values()), None)
                    ),
                    with_kwargs=True,
                )
            )
            handles.append(block.register_forward_hook(lambda module, args, output: keep("layer_output", output)))
    vocab = getattr(model.config.get_text_config(decoder=True), "vocab_size", None) or 16
    forward = f"a forward of {LAYOUT_PROMPTS} prompts of {LAYOUT_TOKENS[0]} tokens"
    shapes: dict[str, list[tuple[int, ...]]] = {}
    try:
        for length in LAYOUT_TOKENS:
            seen.clear()
            tokens = torch.arange(LAYOUT_PROMPTS * length).view(LAYOUT_PROMPTS, length) % max(vocab - 3, 1) + 3
            with torch.no_grad():
                output = model(input_ids=tokens.to(model.device))
            if getattr(output, "logits", None) is None:  # an encoder's hidden states, no head
                family.no_logits = (
                    f"the model's output ({type(output).__name__}) holds no logits: it has no head; its last block's "
                    f"output is layers[-1].layer_output"
                )
            keep("logits", getattr(output, "logits", None))
            if "layer_input" in served and "layer_input" not in seen:  # SqueezeBERT's `layer.forward(...)`
                family.blocks_not_once = (
                    f"the blocks of {family.layers} never run as modules (their forward is called directly, past "
                    f"the module call that nnsight and hooks see), so no block input or output can be read"
                )
            for name, kept in seen.items():  # the first block laid out otherwise, else the first
                odd = (
                    shape
                    for shape in kept
                    if len(shape) != len(BY_NAME[name].axes) or shape[:2] != (LAYOUT_PROMPTS, length)
                )
                shapes.setdefault(name, []).append(next(odd, kept[0]))
    except Exception as error:  # noqa: BLE001  (a model that needs more than token ids: say it was not compared)
        return {
            name: f"its layout was not compared with docs/values.md: {forward} failed at load ({type(error).__name__})"
            for name in served
        }
    finally:
        for handle in handles:
            handle.remove()
    found = {}
    for name, (short, long) in ((name, pair) for name, pair in shapes.items() if len(pair) == 2):
        axes = BY_NAME[name].axes
        documented, given = f"[{', '.join(axes)}]", f"{forward} gives {list(short)} at load"
        if len(short) == len(axes) == len(long) and short[0] == long[0] == LAYOUT_PROMPTS:
            (prompt, longer), (seq, longer_seq) = LAYOUT_TOKENS, (short[1], long[1])
            if (seq, longer_seq) == (prompt, longer):
                continue
            if seq * longer == longer_seq * prompt and seq % prompt == 0:  # the same multiple of both prompts
                found[name] = (
                    f"its seq axis holds {seq // prompt} streams of the prompt's positions, stacked, "
                    f"not {documented}'s one ({given})"
                )
                continue
            if seq - prompt == longer_seq - longer > 0:  # the same number of positions beyond both prompts
                found[name] = (
                    f"its seq axis holds {seq - prompt} positions of the model's own besides the "
                    f"prompt's, not {documented}'s prompt alone ({given})"
                )
                continue
        if len(short) == len(axes) and short[:2] == (LAYOUT_TOKENS[0], LAYOUT_PROMPTS):
            swapped = ", ".join([axes[1], axes[0], *axes[2:]])
            found[name] = f"sequence-first here: [{swapped}], not {documented} ({given})"
        else:
            found[name] = f"not {documented} here: {given}"
    return found


def interface_call(cls) -> dict | None:
    """How `cls.forward` calls the shared attention interface (`ALL_ATTENTION_FUNCTIONS`): the operation nnsight names
    for the call, its positional arguments and keywords (as source), the names it is called by, and the eager function
    it falls back to (looked up now: a module's function may be replaced); None where it never calls it."""
    found = _interface(cls)
    if found is None:
        return None
    function, fallbacks, call = found
    eager = next(
        (
            function.__globals__[n]
            for n in fallbacks
            if callable(function.__globals__.get(n))
            and n != "ALL_ATTENTION_FUNCTIONS"
            and hasattr(function.__globals__[n], "__code__")
        ),
        None,
    )
    return {**call, "eager": eager}


@functools.cache
def _interface(cls) -> tuple[Callable, list[str], dict] | None:
    """`interface_call`'s reading of the source, once per class: the forward, the names the eager function may be
    under, and the call."""
    function, code = compiled(cls.forward)
    tree = ast.parse(code.source)
    names, fallbacks = set(), []
    assignments = [node for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))]
    for node in assignments:
        if node.value is not None and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            fallbacks += [n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)]
    for node in assignments:  # `attention_interface = eager_attention_forward`, then the interface if not eager
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if isinstance(node.value, ast.Name) and any(isinstance(t, ast.Name) and t.id in names for t in targets):
            fallbacks.append(node.value.id)
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
    ]
    if not calls:
        return None
    call = min(calls, key=lambda node: node.lineno)
    operation = next(
        (name for name, line in code.lines.items() if line == call.lineno and name.rsplit("_", 1)[0] == call.func.id),
        None,
    )
    return (
        function,
        fallbacks,
        {
            "operation": operation,
            "arguments": [ast.unparse(a) for a in call.args],
            "keywords": {k.arg: ast.unparse(k.value) for k in call.keywords if k.arg},
            "names": frozenset(names),
        },
    )


class Flow:
    """What a forward computes from its input, read from its source: each name's value as an expression of calls of
    the `owner`'s child modules (`("call", child, argument)`), sums (`("add", a, b)`), the forward's `("input",)`,
    the attention interface's output (`("interface",)`) and anything else as `("other", source)`. Dropout is the
    identity (the model is evaluated); so are the methods in `transparent`. An `if` whose branches call children the
    owner lacks keeps only the branch it can take; where both can run and disagree, the names they set are "other"."""

    def __init__(
        self,
        owner: torch.nn.Module,
        transparent: tuple[str, ...] = (),
        callables: tuple[str, ...] = (),
        interface: set[str] | frozenset[str] = frozenset(),
    ):
        self.owner, self.transparent, self.callables, self.interface = owner, transparent, callables, interface

    def run(self, function: Callable) -> tuple | None:
        """The forward's returned value (the first item of a tuple); None where it returns nothing it can read."""
        _, tree = _forward_tree(function)
        params = [a.arg for a in tree.args.args if a.arg != "self"]
        env = {params[0]: ("input",)} if params else {}
        _, returned = self.statements(tree.body, env)
        return returned

    def statements(self, body: list[ast.stmt], env: dict) -> tuple[dict, tuple | None]:
        for node in body:
            if isinstance(node, ast.Return):
                return env, self.value(node.value, env) if node.value is not None else None
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                value = self.value(node.value, env)
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    self.assign(target, value, env)
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                if isinstance(node.op, ast.Add):
                    env[node.target.id] = (
                        "add",
                        env.get(node.target.id, ("other", node.target.id)),
                        self.value(node.value, env),
                    )
                else:
                    env[node.target.id] = ("other", ast.unparse(node))
            elif isinstance(node, ast.If):
                live = [branch for branch in (node.body, node.orelse) if self.live(branch)]
                outcomes = [self.statements(branch, dict(env)) for branch in live]
                if len(outcomes) == 1:
                    env, returned = outcomes[0]
                    if returned is not None:
                        return env, returned
                elif len(outcomes) == 2:
                    (first, r1), (second, r2) = outcomes
                    if r1 is not None or r2 is not None:
                        return env, r1 if r1 == r2 else ("other", f"depends on `{ast.unparse(node.test)}`")
                    env = {
                        name: first.get(name)
                        if first.get(name) == second.get(name)
                        else ("other", f"depends on `{ast.unparse(node.test)}`")
                        for name in {*first, *second}
                    }
            elif isinstance(node, (ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                        env[inner.id] = ("other", ast.unparse(node).splitlines()[0])
        return env, None

    def assign(self, target: ast.expr, value: tuple, env: dict) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):  # `out, weights = f(...)`: the first item is the output
            for i, element in enumerate(target.elts):
                self.assign(element, value if i == 0 else ("other", ast.unparse(target)), env)

    def live(self, body: list[ast.stmt]) -> bool:
        """Whether a branch can run on this owner: it calls none of `self`'s children that the owner lacks."""
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "self"
                and not hasattr(self.owner, node.func.attr)
            ):
                return False
        return True

    def value(self, node: ast.expr, env: dict) -> tuple:
        if isinstance(node, ast.Name):
            return env.get(node.id, ("other", node.id))
        if isinstance(node, (ast.Tuple, ast.List)) and node.elts:  # a returned tuple: its first item
            return self.value(node.elts[0], env)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == 0:
            inner = self.value(node.value, env)
            if inner[0] in ("call", "interface"):  # a module's output tuple: its first item
                return inner
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return ("add", self.value(node.left, env), self.value(node.right, env))
        if isinstance(node, ast.Call):
            called = self.call(node, env)
            if called is not None:
                return called
        return ("other", ast.unparse(node))

    def call(self, node: ast.Call, env: dict) -> tuple | None:
        function = node.func
        first = (
            node.args[0]
            if node.args
            else next(
                (k.value for k in node.keywords if k.arg == "hidden_states"),
                node.keywords[0].value if node.keywords and node.keywords[0].arg else None,
            )
        )
        if isinstance(function, ast.Name) and function.id in self.interface:
            return ("interface",)
        if isinstance(function, ast.Name) and function.id in self.callables and first is not None:
            return ("call", function.id, self.value(first, env))
        if isinstance(function, ast.Attribute):
            name = function.attr
            if isinstance(function.value, ast.Name) and function.value.id == "self":
                if not hasattr(self.owner, name):
                    return ("other", f"self.{name}(...), which {type(self.owner).__name__} does not have")
                child = getattr(self.owner, name)
                if isinstance(child, torch.nn.Dropout) and first is not None:
                    return self.value(first, env)
                if isinstance(child, torch.nn.Module) and first is not None:
                    return ("call", name, self.value(first, env))
                return None
            if name == "dropout" and first is not None:  # nn.functional.dropout(x, p=..., training=...)
                return self.value(first, env)
            if name in self.transparent:
                return self.value(function.value, env)
        return None


def render(expression: tuple | None) -> str:
    """An expression of `Flow` in words: `post_attention_layernorm(x + self_attn(input_layernorm(x)))`."""
    if expression is None:
        return "nothing"
    kind = expression[0]
    if kind == "input":
        return "x"
    if kind == "interface":
        return "the attention interface's output"
    if kind == "call":
        return f"{expression[1]}({render(expression[2])})"
    if kind == "add":
        return f"{render(expression[1])} + {render(expression[2])}"
    return f"`{expression[1]}`"


def sublayer(expression: tuple, stream: tuple) -> list[str] | None:
    """The modules a residual sublayer runs, outermost first ([post_norm, module, norm] or [module, norm]), where
    `expression` is `stream + post_norm(module(norm(stream)))` (the post-norm optional); None where it is not."""
    if expression[0] != "add":
        return None
    for residual, update in ((expression[1], expression[2]), (expression[2], expression[1])):
        chain = []
        while residual == stream and update[0] == "call":
            chain.append(update[1])
            update = update[2]
        if residual == stream and update == stream and len(chain) in (2, 3):
            return chain
    return None


def block_names(block: torch.nn.Module) -> dict[str, str | None]:
    """The names the block's forward uses: its pre-norms, mixer, MLP and any post-norms; `NotCommonLayout` where the
    forward is not the common pre-norm residual block."""
    output = Flow(block).run(type(block).forward)
    for mid in (output[1], output[2]) if output and output[0] == "add" else ():
        attention, mlp = sublayer(mid, ("input",)), sublayer(output, mid)
        if attention and mlp:
            names = {
                "attention_norm": attention[-1],
                "mixer": attention[-2],
                "mlp_norm": mlp[-1],
                "mlp": mlp[-2],
                "attention_post_norm": attention[0] if len(attention) == 3 else None,
                "mlp_post_norm": mlp[0] if len(mlp) == 3 else None,
            }
            for role, name in names.items():
                kind = type(getattr(block, name or "", None)).__name__
                if role.endswith("norm") and name and "norm" not in kind.lower():
                    _refuse(
                        "block_forward",
                        f"{type(block).__name__}.forward runs {name} ({kind}) where the common "
                        f"layout has a norm ({role}): {render(output)}",
                    )
            return names
    _refuse(
        "block_forward",
        f"{type(block).__name__}.forward returns {render(output)}, not x + mixer(norm(x)) followed by h + mlp(norm(h))",
    )
    return None


# --- the family ------------------------------------------------------------------------------------------------------


class Inferred(SparseMoE, Family):
    """The common layout with the names found in `model`, verified before it serves (see `CHECKS`). Raises
    `NotCommonLayout` naming the first check that fails."""

    def __init__(self, model: torch.nn.Module):
        self.model_type = model.config.model_type
        self.text_config = model.config.get_text_config(decoder=True)
        #: Value name -> why it is left out (a missing module or an MLP of another shape): served nowhere.
        self.dropped: dict[str, str] = {}
        #: Layer -> the kind tags of `layer_kind` ("moe"; "mixer": no softmax attention there).
        self.kinds: dict[int, frozenset[str]] = {}
        self.mixers: dict[int, tuple[str, str]] = {}  # a hybrid's other mixers by layer: (name, class)
        self.experts: str | None = None
        self.output_projection = None
        self.checking = next(iter(CHECKS))
        try:
            self._find_model(model)
            blocks = model.get_submodule(self.layers)
            self._find_blocks(blocks)
            self._check_mask(model)
            checked = set()
            for layer in self.attention_layers:  # the source once per kind of block, the sizes on every layer
                attention = getattr(blocks[layer], self.attention)
                kind = (type(blocks[layer]), type(attention), self.kinds[layer])
                if kind not in checked:
                    checked.add(kind)
                    self._check_attention(model, layer, blocks[layer])
                self.checking = "sizes"
                self._check_sizes(attention)
        except NotCommonLayout:
            raise
        except Exception as error:  # a forward whose source cannot be read fails the check reading it
            raise NotCommonLayout(self.checking, f"{type(error).__name__}: {error}") from error
        self.absent = {**(moe_absent(self.experts) if self.experts else Family.absent), **self.dropped}

    @property
    def name(self) -> str:
        return f"Inferred({self.model_type})"

    # --- finding the names ---------------------------------------------------------------------------------------

    def _find_model(self, model) -> None:
        layers = block_list(model)
        depth = getattr(self.text_config, "num_hidden_layers", None)
        if depth is None:
            _refuse("blocks", f"{type(self.text_config).__name__} gives no num_hidden_layers")
        if layers is None:
            _refuse("blocks", f"no ModuleList of the config's num_hidden_layers ({depth}) blocks")
        self.layers = layers
        names = {id(m): n for n, m in model.named_modules()}
        self.checking = "embeddings"
        self.embed_tokens = names.get(id(token_embeddings(model)))
        if not self.embed_tokens:
            _refuse("embeddings", "get_input_embeddings() is not a module of the model")
        self.checking = "model_forward"
        parent_path, _, attribute = layers.rpartition(".")
        parent = model.get_submodule(parent_path)
        _, tree = _forward_tree(type(parent).forward)
        if not {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} & set(MASK_FUNCTIONS):
            _refuse(
                "model_forward", f"{type(parent).__name__}.forward builds no mask with {' or '.join(MASK_FUNCTIONS)}"
            )
        loops = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.For) and f"self.{attribute}" in ast.unparse(node.iter)
        ]
        if len(loops) != 1 or not isinstance(loops[0].target, (ast.Name, ast.Tuple)):
            _refuse("model_forward", f"{type(parent).__name__}.forward does not run self.{attribute} in one loop")
        loop = loops[0]
        block = loop.target if isinstance(loop.target, ast.Name) else loop.target.elts[-1]
        stream = Flow(parent, callables=(block.id,)).statements(loop.body, {"hidden_states": ("input",)})[0]
        if stream.get("hidden_states") != ("call", block.id, ("input",)):
            _refuse(
                "model_forward",
                f"in {type(parent).__name__}.forward's loop, hidden_states becomes "
                f"{render(stream.get('hidden_states'))}, not {block.id}(hidden_states)",
            )
        self._find_final_norm(parent_path, parent, tree, loop)

    def _find_final_norm(self, parent_path: str, parent, tree: ast.FunctionDef, loop: ast.For) -> None:
        """The norm the module holding the blocks runs once, after them; its value dropped where there is none."""
        calls = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
            and "norm" in node.func.attr.lower()
            and isinstance(getattr(parent, node.func.attr, None), torch.nn.Module)
        ]
        if len(calls) == 1 and calls[0].lineno > loop.end_lineno:
            self.final_norm = f"{parent_path}.{calls[0].func.attr}".lstrip(".")
        else:
            self.final_norm = None
            self.dropped["final_norm_output"] = (
                f"{type(parent).__name__}.forward does not run one norm once after the blocks (it calls "
                f"{', '.join(c.func.attr for c in calls) or 'no norm'}); register the family to name its final norm"
            )

    def _find_blocks(self, blocks) -> None:
        self.checking = "block_forward"
        by_kind = {}  # blocks of one class with the same modules read the same
        for block in blocks:
            kind = type(block), tuple(block._modules)
            if kind not in by_kind:
                by_kind[kind] = block_names(block)
        found = [by_kind[type(block), tuple(block._modules)] for block in blocks]
        self.checking = "attention_module"
        self.attention_layers = [
            i
            for i, (names, block) in enumerate(zip(found, blocks))
            if interface_call(type(getattr(block, names["mixer"]))) is not None
        ]
        if not self.attention_layers:
            kinds = sorted({type(getattr(b, names["mixer"])).__name__ for names, b in zip(found, blocks)})
            _refuse("attention_module", f"no block's mixer calls the attention interface ({', '.join(kinds)})")
        self.checking = "same_names"
        first = found[self.attention_layers[0]]
        for layer, names in enumerate(found):
            same = {role: name for role, name in names.items() if role != "mixer" or layer in self.attention_layers}
            differ = [
                f"{role} {name!r} (block {self.attention_layers[0]}: {first[role]!r})"
                for role, name in same.items()
                if name != first[role]
            ]
            if differ:
                _refuse("same_names", f"block {layer} uses {', '.join(differ)}")
            if layer not in self.attention_layers:
                self.mixers[layer] = names["mixer"], type(getattr(blocks[layer], names["mixer"])).__name__
        self.attention, self.mlp = first["mixer"], first["mlp"]
        self.attention_norm, self.mlp_norm = first["attention_norm"], first["mlp_norm"]
        self.attention_post_norm, self.mlp_post_norm = first["attention_post_norm"], first["mlp_post_norm"]
        mlps = {}
        for layer, block in enumerate(blocks):
            mlp = getattr(block, self.mlp)
            kind = type(mlp), tuple(mlp._modules)
            if kind not in mlps:
                mlps[kind] = self._find_mlp(mlp)
            self.kinds[layer] = frozenset({"mixer"} if layer not in self.attention_layers else ()) | mlps[kind]

    def _find_mlp(self, mlp: torch.nn.Module) -> frozenset[str]:
        """A sparse MoE (an `experts` module) makes its layers of kind "moe"; otherwise the MLP's activation (`act_fn`,
        called once) and down projection (`down_proj`, whose output the MLP returns), each dropped where missing."""
        experts = getattr(mlp, "experts", None)
        if isinstance(experts, torch.nn.Module):
            self.experts = type(experts).__name__
            return frozenset({"moe"})
        kind = type(mlp).__name__
        children = ", ".join(name for name, _ in mlp.named_children())
        returned = Flow(mlp).run(type(mlp).forward)
        if returned is None or returned[:2] != ("call", self.down_projection):
            self.dropped["mlp_neurons"] = (
                f"{kind}.forward returns {render(returned)}, not the output of a {self.down_projection!r} (its "
                f"modules: {children}); register the family to name what its down projection receives"
            )
        _, tree = _forward_tree(type(mlp).forward)
        uses = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and node.attr == self.activation
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ]
        if not isinstance(getattr(mlp, self.activation, None), torch.nn.Module) or len(uses) != 1:
            self.dropped["mlp_activation"] = (
                f"{kind} has no activation module {self.activation!r} used once in its forward (its modules: "
                f"{children}); register the family to name its activation"
            )
        return frozenset()

    # --- verifying the attention ------------------------------------------------------------------------------------

    def _check_mask(self, model) -> None:
        self.checking = "mask"
        types = getattr(self.text_config, "layer_types", None)
        for layer in self.attention_layers:
            if types is not None and types[layer] not in MASKED:
                _refuse(
                    "mask",
                    f"layer {layer} is {types[layer]!r} attention (config.layer_types), not {' or '.join(MASKED)}",
                )
        parent = model.get_submodule(self.layers.rpartition(".")[0])
        _, tree = _forward_tree(type(parent).forward)
        window = self.score_function().sliding_window
        windows = [layer for layer in self.attention_layers if window(self.text_config, layer) is not None]
        if windows and not any(isinstance(node, ast.Name) and node.id == MASK_FUNCTIONS[1] for node in ast.walk(tree)):
            _refuse(
                "mask",
                f"the config gives layers {windows} a sliding window of "
                f"{window(self.text_config, windows[0])}, but {type(parent).__name__}.forward builds no "
                f"{MASK_FUNCTIONS[1]}",
            )

    def _check_attention(self, model, layer: int, block) -> None:
        attention = getattr(block, self.attention)
        kind = type(attention).__name__
        self.checking = "interface_call"
        call = interface_call(type(attention))
        arguments, keywords = call["arguments"], call["keywords"]
        mask = arguments[4:5] == ["attention_mask"] or (
            len(arguments) == 4 and keywords.get("attention_mask") == "attention_mask"
        )
        if call["operation"] != INTERFACE_CALL or arguments[:1] != ["self"] or len(arguments) < 4 or not mask:
            _refuse("interface_call", f"{kind}.forward calls it as {call['operation']}({', '.join(arguments)}, ...)")
        extra = sorted(set(keywords) - set(INTERFACE_KEYWORDS) - {"attention_mask"})
        if keywords.get("scaling") != "self.scaling" or extra:
            _refuse(
                "interface_call",
                f"{kind}.forward passes scaling={keywords.get('scaling')}"
                + (f" and {', '.join(extra)}" if extra else ""),
            )
        self.checking = "output_path"
        returned = Flow(attention, transparent=MERGES, interface=call["names"]).run(type(attention).forward)
        if returned is not None and returned[0] == "call" and returned[2] == ("interface",):
            self.output_projection = self.output_projection or returned[1]
        if returned != ("call", self.output_projection, ("interface",)):
            _refuse(
                "output_path",
                f"{kind}.forward returns {render(returned)}, not the output projection of the "
                f"attention interface's output, merged (reshape, view, contiguous)",
            )
        self.checking = "anchors"
        try:
            self.verify(model, layer, block, attention)
        except LocationDrift as drift:
            _refuse("anchors", str(drift).split(". The installed")[0])
        self.checking = "eager_function"
        self._check_eager(attention, call["eager"])

    def _check_eager(self, attention, eager) -> None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as common

        module = sys.modules[type(attention).__module__]
        own = getattr(module, "eager_attention_forward", None)
        if eager is None or eager is not own:
            _refuse(
                "eager_function",
                f"{type(attention).__name__} falls back to "
                f"{getattr(eager, '__qualname__', eager)}, not {module.__name__}."
                f"eager_attention_forward",
            )
        found, expected = operation_lines(eager), operation_lines(common)
        for name in dict.fromkeys([*expected, *found]):
            if found.get(name) != expected.get(name):
                _refuse(
                    "eager_function",
                    f"{module.__name__}.eager_attention_forward has {name}: "
                    f"`{found.get(name)}`, the common one `{expected.get(name)}`",
                )

    def _check_sizes(self, attention) -> None:
        kind = type(attention).__name__
        heads = self.sizes.geometry(attention, self)
        groups = attention.num_key_value_groups
        h, kv, d = heads.num_heads, heads.num_kv_heads, heads.head_dim
        if (
            not all(isinstance(n, int) and n > 0 for n in (h, kv, d))
            or h % kv
            or groups != h // kv
            or not isinstance(heads.scale, float)
        ):
            _refuse(
                "sizes",
                f"{kind}: {h} heads, {kv} key/value heads, head_dim {d}, num_key_value_groups "
                f"{groups}, scaling {heads.scale!r}",
            )
        separate = getattr(attention, "q_proj", None) is not None
        expected = {"q_proj": h * d, "k_proj": kv * d, "v_proj": kv * d} if separate else {"qkv_proj": (h + 2 * kv) * d}
        found = {name: getattr(getattr(attention, name, None), "out_features", None) for name in expected}
        width = getattr(getattr(attention, self.output_projection), "in_features", None)
        if found != expected or width != h * d:
            _refuse(
                "sizes",
                f"{kind}: projections {found} and {self.output_projection} of input width {width}, for "
                f"{h} heads and {kv} key/value heads of {d} (expected {expected}, {h * d})",
            )

    # --- what it serves ---------------------------------------------------------------------------------------------

    class ScoreFunction(scoring.ScoreFunction):
        """On a multimodal model (its config a composite one), the window and soft-cap are its language model's: the
        text config's, as `_check_mask` reads them."""

        def sliding_window(self, config, layer):
            return super().sliding_window(_text(config), layer)

        def softcap(self, config, layer):
            return super().softcap(_text(config), layer)

        def mask(self, num_queries, num_keys, config, layer, *args, **kwargs):
            return super().mask(num_queries, num_keys, _text(config), layer, *args, **kwargs)

        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            return super().scores(heads, _text(config), queries, keys, layer, key_mask)

    def moe_layer(self, config, layer):
        return "moe" in self.kinds[layer]

    def layer_kind(self, config, layer):
        return super().layer_kind(config, layer) | self.kinds[layer]

    def renames(self, engine="transformers"):
        return {**super().renames(engine), **{mixer: "self_attn" for mixer, _ in self.mixers.values()}}

    def locations(self):
        return {name: location for name, location in super().locations().items() if name not in self.dropped}

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "mixer" in kind:  # no softmax attention: the block's own values, and the mixer's output
            return {
                name: location
                for name, location in locations.items()
                if name not in ATTENTION_VALUES or name == "attention_output"
            }
        return locations

    def unavailable(self, config, layer, engine="transformers"):
        reasons = super().unavailable(config, layer, engine)
        if layer in self.mixers:
            why = (
                "layer {}'s mixer is {} ({}), which does not call the attention interface: no softmax attention "
                "was verified there"
            ).format(layer, *self.mixers[layer])
            reasons.update({name: why for name in ATTENTION_VALUES if name in reasons})
        return reasons

    def notes(self, config, layer, engine="transformers"):
        notes = {
            **super().notes(config, layer, engine),
            "layer_input": f"{self.name}: the common layout, inferred from the model's structure and verified "
            f"(attnlens.inferred.CHECKS); register the family to keep it (docs/inferred.md)",
        }
        if layer in self.mixers:
            notes["attention_output"] = "the output of {} ({}), this block's mixer: not softmax attention".format(
                *self.mixers[layer]
            )
        return notes

    # --- registering it properly --------------------------------------------------------------------------------

    def found(self) -> dict[str, str | None]:
        """The names found that differ from the common layout's (`attnlens.Family`)."""
        roles = (
            "layers",
            "embed_tokens",
            "final_norm",
            "attention",
            "mlp",
            "attention_norm",
            "mlp_norm",
            "attention_post_norm",
            "mlp_post_norm",
            "output_projection",
            "activation",
            "down_projection",
        )
        return {role: getattr(self, role) for role in roles if getattr(self, role) != getattr(Family, role)}

    def registration(self) -> str:
        """Source of a family registering what was inferred: the names found, the MoE layers, what is dropped."""
        title = "".join(part.capitalize() for part in self.model_type.replace("-", "_").split("_"))
        bases = "SparseMoE, attnlens.Family" if self.experts else "attnlens.Family"
        lines = ["import attnlens"] + (["from attnlens.parts.moe import SparseMoE, moe_absent"] if self.experts else [])
        lines += [
            "",
            "",
            "@attnlens.register",
            f"class {title}({bases}):",
            f"    model_types = ({json.dumps(self.model_type)},)",
        ]
        lines += [f"    {role} = {json.dumps(name) if name else None}" for role, name in self.found().items()]
        if self.mixers:
            mixers = sorted({f"{name} ({kind})" for name, kind in self.mixers.values()})
            lines.append(
                f"    # layers {sorted(self.mixers)} run {', '.join(mixers)}, not softmax attention: "
                f"describe them with layer_kind and kind_locations"
            )
        absent = f"moe_absent({json.dumps(self.experts)})" if self.experts else "attnlens.Family.absent"
        if self.dropped:
            lines += [
                f"    absent = {{**{absent},",
                *(f"              {json.dumps(name)}: {json.dumps(reason)}," for name, reason in self.dropped.items()),
                "    }",
            ]
            lines += [
                "",
                "    def locations(self):",
                "        locations = super().locations()",
                f"        for name in ({', '.join(map(json.dumps, self.dropped))},):",
                "            del locations[name]",
                "        return locations",
            ]
        elif self.experts:
            lines.append(f"    absent = {absent}")
        moe = [layer for layer, kind in self.kinds.items() if "moe" in kind]
        if self.experts and len(moe) < len(self.kinds):
            lines += [
                "",
                "    def moe_layer(self, config, layer):",
                f"        return layer in {moe}  # in this model: state the config's rule",
            ]
        return "\n".join(lines) + "\n"

    def advice(self) -> str:
        """The warning a model served by this family loads with."""
        return (
            f"attnlens has no family for model type {self.model_type!r}, but its blocks are the common layout: "
            f"every check of attnlens.inferred.CHECKS passed, so it serves the full vocabulary as {self.name}"
            + (f" (except {', '.join(self.dropped)})" if self.dropped else "")
            + ". To register it properly (and have it tested with the identities, attnlens.checks), add:\n\n"
            + self.registration()
        )
