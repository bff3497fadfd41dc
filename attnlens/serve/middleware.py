"""The API server's side: vLLM's OpenAI app with an ASGI middleware that answers `attention` in requests.

`attnlens serve` adds `Attention` to vLLM's app (vLLM's own `--middleware` option). A POST to `/v1/completions` or
`/v1/chat/completions` whose body has no `attention` passes through untouched, byte for byte. One with `attention`
is checked (`AttentionRequest`, the layers, heads and spans against the model, the output budget), then handed to
vLLM without the field and with the plan in `vllm_xargs` (the worker reduces its rows: attnlens/vllm/serving.py);
the numbers are taken from the worker (`collective_rpc`) when the response is complete, or at each streamed chunk,
and added beside `choices`. Bad input gets HTTP 400 with vLLM's error body, `param` naming the field; the attention
routes (`GET /v1/attention/schema`, `/v1/attention/features`) answer behind vLLM's API key like its own.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import uuid
from typing import Any

import orjson
import torch

from .. import row_features
from .protocol import AttentionRequest, ChoiceAttention, schema

#: Environment variable `attnlens serve` sets for its API servers: the most values one request may ask for.
MAX_VALUES_ENV = "ATTNLENS_ATTENTION_MAX_VALUES"
MAX_VALUES = 4_000_000
ROUTES = ("/v1/completions", "/v1/chat/completions")
#: Seconds a take of a request's numbers may wait on the engine (one that is shutting down answers no more).
TAKE_S = 10.0


class BadAttention(Exception):
    """A request's `attention` the server refuses: HTTP 400 naming `param` (its message starts with it)."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param


class Model:
    """What the API server knows of the served model, from vLLM's config: its family, served layers, heads,
    tokenizer and the output budget."""

    def __init__(self, state: Any) -> None:
        from transformers import AutoTokenizer

        from ..vllm import serving
        from ..vllm.worker import family_of

        vllm_config, args = state.vllm_config, state.args
        config = vllm_config.model_config.hf_config
        self.config = config.get_text_config()
        self.family = family_of(self.config, vllm_config.additional_config)
        self.num_layers = self.config.num_hidden_layers
        self.layers = serving.layers_served(self.family, self.config, self.num_layers)
        self.num_heads = self.config.num_attention_heads
        self.max_model_len = vllm_config.model_config.max_model_len
        #: vLLM's pipeline stages: each reduces its own layers (`serving.joined`)
        self.stages = vllm_config.parallel_config.pipeline_parallel_size
        self.max_values = int(os.environ.get(MAX_VALUES_ENV) or MAX_VALUES)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        self.name = args.served_model_name[0] if args.served_model_name else args.model

    def refusal(self, layer: int) -> str:
        from ..vllm import static

        taps = static.taps(self.family, self.config, layer)
        if not taps:
            return f"layer {layer} has no attention kernel on vLLM (a linear-attention or recurrent layer)"
        return (
            f"vLLM's attention kernel on layer {layer} does not receive the queries and keys as attnlens serves them "
            f"(it taps {', '.join(taps) or 'nothing'} there)"
        )

    def features(self) -> dict:
        """`GET /v1/attention/features`: what this server serves."""
        return {
            "model": self.name,
            "family": self.family.name,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "layers": self.layers,
            "refused": {
                str(layer): self.refusal(layer) for layer in range(self.num_layers) if layer not in self.layers
            },
            "features": {
                name: {
                    "description": f.description,
                    "arrays": {a: {"dtype": d, "axis": x} for a, (d, x) in f.arrays.items()},
                }
                for name, f in row_features.FEATURES.items()
            },
            "max_values": self.max_values,
        }


# --- a request's plan ------------------------------------------------------------------------------------------------


def parse(body: dict) -> AttentionRequest:
    from pydantic import ValidationError

    try:
        return AttentionRequest.model_validate(body["attention"])
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in ("attention", *first["loc"]))
        raise BadAttention(where, f"{first['msg']}") from None


def _indexes(given: list[int] | None, total: int, what: str) -> list[int]:
    if given is None:
        return list(range(total))
    found = []
    for i, index in enumerate(given):
        if not -total <= index < total:
            raise BadAttention(
                f"attention.{what}.{i}",
                f"{what[:-1]} {index} is out of range: this model has "
                f"{total} {what} (0 to {total - 1}, or negative from the last)",
            )
        found.append(index % total)
    if len(set(found)) != len(found):
        raise BadAttention(f"attention.{what}", f"{found} names a {what[:-1]} twice")
    return sorted(found)


def _prompts(model: Model, body: dict, chat: bool) -> list[tuple[str | None, list[int]]]:
    """Each prompt's text (None for token ids) and token ids, as vLLM tokenizes them."""
    tokenizer = model.tokenizer
    if chat:
        text = tokenizer.apply_chat_template(
            body.get("messages") or [],
            tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
        )
        return [(text, tokenizer(text, add_special_tokens=body.get("add_special_tokens", False))["input_ids"])]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    found = []
    for one in prompt if isinstance(prompt, list) else []:
        if isinstance(one, str):
            found.append((one, tokenizer(one, add_special_tokens=body.get("add_special_tokens", True))["input_ids"]))
        elif isinstance(one, list):
            found.append((None, list(one)))
    return found


def _spans(request: AttentionRequest, model: Model, body: dict, chat: bool, prompts: list) -> list[tuple[int, int]]:
    """span_mass's spans as token ranges of the prompt."""
    if not request.spans:
        return []
    textual = any(span.tokens is None for span in request.spans)
    if textual and (len(prompts) != 1 or prompts[0][0] is None):
        raise BadAttention("attention.spans", "chars and message spans need one text prompt; give token ranges")
    found = []
    text, ids = prompts[0] if prompts else (None, [])
    offsets = None
    if textual:
        offsets = model.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        offsets = [(a, b) for a, b in offsets]
        shift = len(ids) - len(offsets)  # special tokens vLLM's tokenization put first (a BOS)
    for i, span in enumerate(request.spans):
        where = f"attention.spans.{i}"
        if span.tokens is not None:
            found.append(tuple(span.tokens))
            continue
        if span.message is not None:
            if not chat:
                raise BadAttention(where, "message spans are for /v1/chat/completions")
            chars = _message_chars(body.get("messages") or [], text, span.message, where)
        else:
            chars = span.chars
            if chars[1] > len(text):
                raise BadAttention(where, f"chars end {chars[1]} is past the prompt's {len(text)} characters")
        tokens = [t for t, (a, b) in enumerate(offsets) if a < chars[1] and b > chars[0]]
        if not tokens:
            raise BadAttention(where, f"characters {list(chars)} cover no token of the prompt")
        found.append((tokens[0] + shift, tokens[-1] + 1 + shift))
    return found


def _message_chars(messages: list, text: str, index: int, where: str) -> tuple[int, int]:
    """The characters of message `index`'s content in the rendered chat prompt (found in order)."""
    if index >= len(messages):
        raise BadAttention(where, f"message {index} is out of range: the chat has {len(messages)} messages")
    at = 0
    for i, message in enumerate(messages[: index + 1]):
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        found = text.find(content, at) if content else -1
        if found < 0:
            raise BadAttention(where, f"message {i}'s content is not in the prompt its chat template renders")
        if i == index:
            return found, found + len(content)
        at = found + len(content)
    raise AssertionError("unreachable")


def plan(model: Model, body: dict, chat: bool) -> tuple[dict, list[tuple[int, int]], list[int]]:
    """The worker's plan for this request, its spans as token ranges and each prompt's length; refused with
    `BadAttention` where the request is wrong or asks for more than the budget."""
    request = parse(body)
    layers = _indexes(request.layers, model.num_layers, "layers")
    refused = [layer for layer in layers if layer not in model.layers]
    if refused:
        raise BadAttention("attention.layers", f"{model.refusal(refused[0])}; served layers: {model.layers}")
    heads = _indexes(request.heads, model.num_heads, "heads")
    prompts = _prompts(model, body, chat)
    spans = _spans(request, model, body, chat, prompts)
    lengths = [len(ids) for _, ids in prompts] or [model.max_model_len]
    for i, (start, end) in enumerate(spans):
        if end > min(lengths):
            raise BadAttention(
                f"attention.spans.{i}",
                f"tokens [{start}, {end}) end past the prompt's {min(lengths)} tokens",
            )
    n = _count(body.get("n"))
    asked = _count(body.get("max_completion_tokens") or body.get("max_tokens"), None)
    values = 0
    for length in lengths:
        generated = asked if asked else max(0, model.max_model_len - length)
        rows = {"generated": generated, "prompt": length, "all": length + generated}[request.rows]
        request_rows = row_features.Rows(torch.zeros(0), length, tuple(spans), request.top_k)
        width = sum(row_features.FEATURES[name].width(request_rows, length + generated) for name in request.features)
        values += n * len(layers) * len(heads) * rows * width
    if values > model.max_values:
        raise BadAttention(
            "attention",
            f"this request may return {values:,} values, over this server's budget of "
            f"{model.max_values:,} (--attention-max-values); ask for fewer layers, heads, rows or tokens",
        )
    found = {
        "features": request.features,
        "layers": layers,
        "heads": None if request.heads is None else heads,
        "rows": request.rows,
        "spans": spans,
        "top_k": request.top_k,
    }
    return found, spans, lengths


# --- the numbers into a response --------------------------------------------------------------------------------------


def _count(value, default: int | None = 1) -> int | None:
    """A positive count from the body (vLLM checks the field itself)."""
    return value if isinstance(value, int) and value > 0 else default


def choice_index(request_id: str, n: int, chat: bool) -> int:
    """The choice of vLLM's request id: completions number their prompts (`cmpl-ID-P-RANDOM`), `n` > 1 numbers
    each prompt's samples (`S_...`); choices are laid out prompt by prompt."""
    sample = 0
    match = re.match(r"(\d+)_", request_id)
    if n > 1 and match:
        sample, request_id = int(match[1]), request_id[match.end() :]
    prompt = 0 if chat else int(re.search(r"-(\d+)-[^-]+$", request_id)[1])
    return prompt * n + sample


def encoded(array: torch.Tensor, encoding: str, dtype: str) -> dict:
    if encoding == "base64":
        if array.is_floating_point():
            array = array.to(getattr(torch, dtype))
        flat = array.contiguous().numpy()
        data = base64.b64encode(flat.astype(flat.dtype.newbyteorder("<"), copy=False).tobytes())
        return {"shape": list(array.shape), "dtype": str(array.dtype).removeprefix("torch."), "data": data.decode()}
    # a numpy array, which `dumps` writes as nested lists (NaN as null: JSON has none) in C
    data = array.contiguous().numpy()
    return {"shape": list(array.shape), "dtype": str(array.dtype).removeprefix("torch."), "data": data}


def dumps(content: Any) -> bytes:
    """JSON of a response or chunk holding the numbers as numpy arrays (`encoded`): orjson writes them in C, each
    float32 as the shortest decimal that reads back to it, where the standard library's `json` would spend a core
    formatting them one Python float at a time."""
    return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def choices_attention(taken: dict, request: dict, lengths: list[int], n: int, chat: bool) -> dict[int, dict]:
    """Per choice index, its `ChoiceAttention` (as a dict) from the worker's numbers by vLLM's request id."""
    from ..vllm.serving import unwire

    plan, found = request["plan"], {}
    heads = plan["heads"]
    for request_id, numbers in taken.items():
        index = choice_index(request_id, n, chat)
        arrays = {
            name: encoded(unwire(array), request["encoding"], request["dtype"])
            for name, array in numbers["arrays"].items()
        }
        found[index] = ChoiceAttention(
            index=index,
            layers=plan["layers"],
            heads=list(range(request["num_heads"])) if heads is None else heads,
            positions=unwire(numbers["positions"]).tolist(),
            prompt_tokens=lengths[index // n] if index // n < len(lengths) else lengths[0],
            spans=plan["spans"],
            error=numbers.get("error"),
        ).model_dump(exclude_none=True)
        found[index]["arrays"] = arrays  # as `encoded` made them (JSON's numpy arrays go to `dumps` as they are)
    return found


# --- the middleware ---------------------------------------------------------------------------------------------------


class Attention:
    """ASGI middleware on vLLM's app (`--middleware attnlens.serve.middleware.Attention`)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.model: Model | None = None

    def _model(self, scope: dict) -> Model:
        if self.model is None:
            self.model = Model(scope["app"].state)
        return self.model

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path.startswith("/v1/attention/"):
            await self._route(scope, receive, send, path)
            return
        if scope["method"] != "POST" or path not in ROUTES:
            await self.app(scope, receive, send)
            return
        body = await _read(receive)
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or "attention" not in parsed:  # plain vLLM, the body as it came
            await self.app(scope, _replay(body, receive), send)
            return
        if not _authorized(scope):
            await _json(send, 401, {"error": "Unauthorized"})
            return
        chat = path == ROUTES[1]
        try:
            model = self._model(scope)
            plan_, _, lengths = plan(model, parsed, chat)
        except BadAttention as error:
            await _json(send, 400, _error(str(error), error.param))
            return
        except Exception as error:  # noqa: BLE001  the body's other fields, malformed (messages vLLM would refuse)
            reason = f"attention: the request's prompt could not be read ({type(error).__name__}: {error})"
            await _json(send, 400, _error(reason, "attention"))
            return
        await self._served(scope, receive, send, parsed, plan_, lengths, chat)

    async def _served(self, scope, receive, send, body: dict, plan_: dict, lengths: list[int], chat: bool) -> None:
        from ..vllm import serving, static

        model = self.model
        tag = f"{serving.TAG}{uuid.uuid4().hex}"
        attention = body.pop("attention")
        body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), static.CONFIG_KEY: tag, serving.KEY: json.dumps(plan_)}
        if plan_["rows"] != "generated":  # prompt rows: none may come from the prefix cache (never computed)
            body["cache_salt"] = tag
        request = {
            "plan": plan_,
            "encoding": attention.get("encoding", "json"),
            "dtype": attention.get("dtype", "float32"),
            "num_heads": model.num_heads,
        }
        n = _count(body.get("n"))
        engine = scope["app"].state.engine_client

        async def take(final: bool) -> dict:
            """Per choice index, its numbers so far; on a failure, under None, the reason (the response still goes
            out, each choice's `attention` saying why it has none)."""
            if model.stages > 1 and not final:  # the stages run a step apart: a stream's numbers come at its end
                return {}
            try:
                if engine.errored:
                    raise RuntimeError("the engine stopped (a shutdown, or a fault) before these numbers were taken")
                # bounded here: an engine draining at SIGTERM rejects the call, and the answer may never come
                rpc = engine.collective_rpc("attnlens_serve_take", args=(tag, final))
                taken = await asyncio.wait_for(rpc, TAKE_S)
                return choices_attention(serving.joined(taken, model.stages), request, lengths, n, chat)
            except Exception as error:  # noqa: BLE001  the completion is the client's either way
                reason = f"{type(error).__name__}: {' '.join(str(error).split())}"
                return {None: {"error": f"these rows' numbers were not taken from the engine ({reason})"}}

        data = json.dumps(body).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        inner_scope = {**scope, "headers": [*headers, (b"content-length", str(len(data)).encode())]}
        relay = _Relay(send, take)
        try:
            await self.app(inner_scope, _replay(data, receive), relay)
        finally:
            await relay.close()

    async def _route(self, scope, receive, send, path: str) -> None:
        if not _authorized(scope):
            await _json(send, 401, {"error": "Unauthorized"})
            return
        if scope["method"] != "GET":
            await _json(send, 405, _error(f"{path} answers GET", None, 405))
            return
        if path == "/v1/attention/schema":
            await _json(send, 200, schema())
            return
        if path == "/v1/attention/features":
            await _json(send, 200, self._model(scope).features())
            return
        if path == "/v1/attention/held":  # per rank: requests and bytes held for served requests (0 when idle)
            held = await scope["app"].state.engine_client.collective_rpc("attnlens_serve_held")
            await _json(send, 200, {"ranks": held})
            return
        known = "/v1/attention/schema, /v1/attention/features and /v1/attention/held"
        await _json(send, 404, _error(f"no route {path}; the attention routes are {known}", None, 404))


class _Relay:
    """vLLM's response on its way out, with the numbers added: a JSON body once complete, or each event of a stream
    with the numbers taken since the one before (the rest in an event of its own before `[DONE]`)."""

    def __init__(self, send: Any, take: Any) -> None:
        self.send, self.take = send, take
        self.start: dict | None = None
        self.streaming = False
        self.body = b""
        self.closed = False
        self.last: dict = {}
        self.indexes: set[int] = set()  # the choices a stream has shown

    def _entries(self, numbers: dict) -> list[dict]:
        """A take's entries; its failure (under None) given to every choice the stream has shown."""
        failed = numbers.pop(None, None)
        found = list(numbers.values())
        if failed:
            found += [{"index": index, **failed} for index in sorted(self.indexes)]
        return found

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            types = [v for k, v in message.get("headers", []) if k.lower() == b"content-type"]
            self.streaming = bool(types) and types[0].startswith(b"text/event-stream")
            if self.streaming:
                await self.send(message)
            return
        if message["type"] != "http.response.body":
            await self.send(message)
            return
        self.body += message.get("body", b"")
        more = message.get("more_body", False)
        if self.streaming:
            await self._events(more)
            return
        if more:
            return
        status = self.start["status"]
        body = self.body
        if status == 200:
            response = json.loads(body)
            numbers = await self._final()
            failed = numbers.get(None, {})
            response["attention"] = [
                numbers.get(c["index"], {"index": c["index"], **failed}) for c in response["choices"]
            ]
            body = dumps(response)
        headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
        await self.send({**self.start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await self.send({"type": "http.response.body", "body": body})

    async def _events(self, more: bool) -> None:
        *events, self.body = self.body.split(b"\n\n")
        out = []
        for event in events:
            if not event.startswith(b"data: "):
                out.append(event)
                continue
            payload = event[len(b"data: ") :]
            if payload == b"[DONE]":
                rest = self._entries(await self._final())
                if rest:
                    out.append(b"data: " + dumps({**self.last, "choices": [], "attention": rest}))
                out.append(event)
                continue
            chunk = json.loads(payload)
            self.last = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
            self.indexes.update(choice["index"] for choice in chunk.get("choices") or ())
            numbers = self._entries(await self.take(False))
            if numbers:
                chunk["attention"] = numbers
                event = b"data: " + dumps(chunk)
            out.append(event)
        if out:
            await self.send(
                {"type": "http.response.body", "body": b"".join(e + b"\n\n" for e in out), "more_body": True}
            )
        if not more:
            await self.send({"type": "http.response.body", "body": self.body, "more_body": False})

    async def _final(self) -> dict:
        self.closed = True
        return await self.take(True)

    async def close(self) -> None:
        """Free the request's numbers in the worker if the response never completed (a client that left)."""
        if not self.closed:
            self.closed = True
            await self.take(True)


# --- ASGI plumbing ----------------------------------------------------------------------------------------------------


async def _read(receive: Any) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # the client's disconnect, when it comes

    return replay


def _error(message: str, param: str | None, code: int = 400) -> dict:
    kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed"}.get(code, "Error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def _json(send: Any, status: int, content: dict) -> None:
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _authorized(scope: dict) -> bool:
    """vLLM's own check of `--api-key` (or `VLLM_API_KEY`), for the requests this middleware answers itself."""
    from starlette.datastructures import Headers
    from vllm import envs
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    args = scope["app"].state.args
    tokens = [key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]
    return not tokens or AuthenticationMiddleware(None, tokens).verify_token(Headers(scope=scope))
