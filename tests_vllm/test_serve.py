"""`attnlens serve`: vLLM's OpenAI server on SmolLM2 (float32), answered by real clients (the `openai` package and
curl) on 127.0.0.1, its numbers checked against the eager engine's pattern on the same tokens (`row_features.of_pattern`
on `attention_probabilities`, abs 1e-4: vLLM's kernels against eager float32 attention), bad input against HTTP 400s.

One server for the module (about 2 minutes to start: vLLM compiles the model), with an API key and a small output
budget; marked `ranks` (the server is three processes), so `make test-vllm` runs it with the other multi-process
tests, alone.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import attnlens
from attnlens import client, row_features

pytestmark = pytest.mark.ranks

KEY = "attnlens-test-key"
MAX_VALUES = 300_000
PROMPT = "When Mary and John went to the store, John gave a drink to"
NAMES = list(row_features.FEATURES)
#: requests in the soak test (make test's; 2,000 by hand: ATTNLENS_SOAK=2000)
SOAK = int(os.environ.get("ATTNLENS_SOAK", "400"))
TOLERANCE = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, port: int, process: subprocess.Popen, log: Path) -> None:
        self.port, self.process, self.log = port, process, log
        self.url = f"http://127.0.0.1:{port}"
        self.model = "smollm2"  # a bundled checkpoint is served under its name

    def post(self, path: str, body, key: str | None = KEY, timeout: float = 120) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        request = urllib.request.Request(self.url + path, data, headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def get(self, path: str, key: str | None = KEY) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=headers), timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def completion(self, attention: dict | None = None, **body) -> dict:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **body}
        if attention is not None:
            body["attention"] = attention
        status, found = self.post("/v1/completions", body)
        assert status == 200, found
        return found

    def held(self) -> list[dict]:
        return self.get("/v1/attention/held")[1]["ranks"]

    def openai(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0)


def started(tmp_path_factory, *arguments: str, env: dict | None = None):
    """`attnlens serve smollm2` (float32) on a free port of 127.0.0.1 with the test's API key and output budget and
    `arguments`; yields its `Server` once it answers, and kills it after."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    unwanted = ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS")
    environment = {k: v for k, v in os.environ.items() if k not in unwanted}
    environment["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: vLLM would take most of the machine's memory
    command = [sys.executable, "-m", "attnlens", "serve", "smollm2", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--dtype", "float32", "--max-model-len", "512", "--api-key", KEY]
    command += ["--attention-max-values", str(MAX_VALUES), *arguments]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**environment, **(env or {})}, start_new_session=True
        )
    server = Server(port, process, log)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"attnlens serve exited {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2):
                break
        except OSError:
            time.sleep(2)
    else:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"attnlens serve did not answer in 600 s:\n{log.read_text()[-4000:]}")
    yield server
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from started(tmp_path_factory)


@pytest.fixture(scope="module")
def eager():
    return attnlens.models.smollm2()


def expected(eager, ids: list[int], found: client.Numbers, names=NAMES, **request) -> dict[str, torch.Tensor]:
    """The served arrays computed on the eager engine's pattern of the same tokens, `[layers, heads, rows, ...]`."""
    patterns = []  # appended in a loop: nnsight runs a trace's body apart, where a comprehension's scope is lost
    with eager.trace(torch.tensor([ids])):
        for layer in found.layers:
            patterns.append(eager.layers[layer].self_attn.attention_probabilities.save())
    per_layer = [
        row_features.of_pattern(names, p[0][found.heads], found.positions, found.prompt_tokens, **request)
        for p in patterns
    ]
    return {name: torch.stack([layer[name] for layer in per_layer]) for name in per_layer[0]}


def assert_equal_numbers(found: client.Numbers, want: dict[str, torch.Tensor]) -> None:
    assert set(found.arrays) == set(want)
    for name, array in found.arrays.items():
        assert array.shape == want[name].shape, name
        if name == "top_keys":
            assert torch.equal(array, want[name]), name
            continue
        assert torch.equal(array.isnan(), want[name].isnan()), name
        torch.testing.assert_close(array.float(), want[name].float(), atol=TOLERANCE, rtol=0, equal_nan=True)


# --- values -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", ["generated", "prompt", "all"])
def test_openai_completions_equal_the_eager_pattern(server, eager, rows):
    """Two prompts in one request (their decode steps scored in one batch in the worker), every feature, three
    layers and heads, against the eager pattern of each choice's own tokens."""
    attention = {"features": NAMES, "layers": [0, 13, -1], "heads": [0, 4, 8], "rows": rows}
    attention["spans"] = [{"tokens": [0, 3]}, {"tokens": [1, 2]}]  # "When Mary and"; " Mary"
    response = server.openai().completions.create(
        model=server.model,
        prompt=[PROMPT, "The capital of France is Paris, and the capital of Italy is"],
        max_tokens=5,
        temperature=0,
        extra_body={"attention": attention, "return_token_ids": True},
    )
    by_index = client.numbers(response)
    assert sorted(by_index) == [0, 1]
    for choice in response.choices:
        found, dumped = by_index[choice.index], choice.model_dump()
        prompt, generated = dumped["prompt_token_ids"], dumped["token_ids"]
        assert found.prompt_tokens == len(prompt) and found.layers == [0, 13, 29] and found.heads == [0, 4, 8]
        first = {"generated": len(prompt) - 1, "prompt": 0, "all": 0}[rows]
        last = len(prompt) if rows == "prompt" else len(prompt) + len(generated) - 1
        assert found.positions == list(range(first, last)) and found.spans == [(0, 3), (1, 2)]
        want = expected(eager, prompt + generated, found, spans=tuple(found.spans), top_k=5)
        assert_equal_numbers(found, want)
        assert torch.allclose(found.arrays["pattern"].sum(-1), torch.ones(()), atol=1e-5)  # each row sums to one


def test_concurrent_requests_asking_different_layers_each_equal_the_eager_pattern(server, eager):
    """Requests in flight together whose plans differ (layers in common and not, different prompts and lengths):
    the worker batches each layer's decode rows over the requests asking for it, and each plan's numbers are its
    own, whole rows included."""
    plans = [
        (PROMPT, {"features": NAMES, "layers": [0, 7], "spans": [{"tokens": [0, 3]}]}),
        ("One two three four", {"features": NAMES, "layers": [7, 29], "heads": [1, 2], "spans": [{"tokens": [1, 4]}]}),
        ("The capital of France is", {"features": ["entropy", "pattern"], "layers": [0, 29], "rows": "all"}),
    ]
    found: dict[int, dict] = {}

    def one(i: int) -> None:
        prompt, attention = plans[i % len(plans)]
        try:
            found[i] = (attention, server.completion(attention, prompt=prompt, max_tokens=4 + i, return_token_ids=True))
        except Exception as error:  # noqa: BLE001  reported below
            found[i] = (attention, error)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(found) == list(range(6))
    assert not [response for _, response in found.values() if isinstance(response, Exception)], found
    for attention, response in found.values():
        numbers, choice = client.numbers(response)[0], response["choices"][0]
        assert numbers.error is None, numbers.error
        ids = choice["prompt_token_ids"] + choice["token_ids"]
        want = expected(eager, ids, numbers, attention["features"], spans=tuple(numbers.spans), top_k=5)
        assert_equal_numbers(numbers, want)


def test_character_spans_are_the_tokens_they_cover(server, eager):
    found = client.numbers(
        server.completion({"features": ["span_mass"], "spans": [{"chars": [5, 9]}, {"chars": [0, 13]}]})
    )[0]
    ids = eager.tokenizer(PROMPT)["input_ids"]
    assert found.spans == [(1, 2), (0, 3)]
    assert eager.tokenizer.decode(ids[1:2]) == " Mary" and eager.tokenizer.decode(ids[0:3]) == "When Mary and"


def test_chat_with_message_spans_streamed_and_not(server, eager):
    """span_mass over whole chat messages (the retrieved document against the question), on a chat template's
    prompt, streamed chunk by chunk and in one response: the same numbers, equal to the eager engine's."""
    messages = [
        {"role": "system", "content": "Answer from the document."},
        {"role": "user", "content": "Document: the key is under the blue pot."},
        {"role": "user", "content": "Where is the key?"},
    ]
    attention = {"features": ["span_mass", "lookback", "entropy"], "spans": [{"message": 1}, {"message": 2}]}
    api = server.openai()
    whole = api.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"attention": attention, "return_token_ids": True},
    )
    chunks = list(
        api.chat.completions.create(
            model=server.model,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"attention": attention},
        )
    )
    found, streamed = client.numbers(whole)[0], client.numbers(chunks)[0]
    assert sum(1 for c in chunks if c.model_dump().get("attention")) >= 2  # the numbers came chunk by chunk
    assert streamed.positions == found.positions and len(found.positions) == 6
    for name in found.arrays:
        torch.testing.assert_close(streamed.arrays[name], found.arrays[name], atol=1e-6, rtol=0, equal_nan=True)
    dumped = whole.model_dump()
    tokens, generated = dumped["prompt_token_ids"], dumped["choices"][0]["token_ids"]
    assert found.prompt_tokens == len(tokens)
    for (start, end), message in zip(found.spans, messages[1:]):
        assert eager.tokenizer.decode(tokens[start:end]).strip() == message["content"]
    want = expected(eager, tokens + generated, found, spans=tuple(found.spans))
    for name in ("span_mass", "lookback", "entropy"):
        torch.testing.assert_close(found.arrays[name], want[name], atol=TOLERANCE, rtol=0, equal_nan=True)
    assert found.arrays["lookback"][:, :, 0].isnan().all()  # the first generated token sees no generated token
    assert not found.arrays["lookback"][:, :, 1:].isnan().any()


def test_curl_base64_float16(server):
    """curl, with the arrays as base64 float16: the JSON float32 numbers to float16's precision."""
    attention = {"features": ["entropy", "top_keys"], "layers": [3], "encoding": "base64", "dtype": "float16"}
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "attention": attention}
    run = subprocess.run(
        ["curl", "-s", "-m", "120", f"{server.url}/v1/completions", "-H", "Content-Type: application/json",
         "-H", f"Authorization: Bearer {KEY}", "-d", json.dumps(body)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    packed = client.numbers(json.loads(run.stdout))[0]
    plain = client.numbers(server.completion({**attention, "encoding": "json"}, max_tokens=3))[0]
    assert packed.arrays["entropy"].dtype == torch.float16 and packed.arrays["top_keys"].dtype == torch.int32
    torch.testing.assert_close(packed.arrays["entropy"].float(), plain.arrays["entropy"], atol=5e-3, rtol=1e-3)
    assert torch.equal(packed.arrays["top_keys"], plain.arrays["top_keys"])


def test_a_request_without_attention_is_served_as_plain_vllm(server):
    plain = server.completion(max_tokens=6)
    asked = server.completion({"features": ["sink"]}, max_tokens=6)
    assert "attention" not in plain
    assert plain["choices"][0]["text"] == asked["choices"][0]["text"]
    assert [a["index"] for a in asked["attention"]] == [0]


def test_prompts_samples_logprobs_and_stop_strings(server):
    """Two prompts, n=2 sampled (seeded), logprobs and a stop string: every choice has its own rows, one per token
    it generated, in choice order (prompt by prompt)."""
    response = server.completion(
        {"features": ["entropy"], "layers": [1]},
        prompt=[PROMPT, "One, two, three, four,"],
        n=2,
        temperature=1.0,
        seed=7,
        logprobs=1,
        max_tokens=8,
        stop=["\n"],
        return_token_ids=True,
    )
    by_index = client.numbers(response)
    assert sorted(by_index) == [0, 1, 2, 3]
    for choice in response["choices"]:
        found = by_index[choice["index"]]
        tokens = len(choice["token_ids"])
        assert choice["logprobs"]["tokens"]
        assert len(found.positions) == tokens and found.arrays["entropy"].shape == (1, 9, tokens)
        assert found.positions[0] == found.prompt_tokens - 1 == len(choice["prompt_token_ids"]) - 1
    assert by_index[0].prompt_tokens == by_index[1].prompt_tokens != by_index[2].prompt_tokens


# --- routes, keys, bad input ------------------------------------------------------------------------------------------


def test_schema_and_features_routes(server):
    status, schema = server.get("/v1/attention/schema")
    assert status == 200 and "features" in schema["request"]["properties"]
    status, served = server.get("/v1/attention/features")
    assert status == 200 and served["layers"] == list(range(30)) and served["num_heads"] == 9
    assert set(served["features"]) == set(NAMES) and served["max_values"] == MAX_VALUES


def test_the_api_key_guards_the_attention_routes(server):
    for path in ("/v1/attention/schema", "/v1/attention/features", "/v1/attention/held"):
        assert server.get(path, key=None)[0] == 401
        assert server.get(path, key="wrong")[0] == 401
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 2, "attention": {"features": ["sink"]}}
    assert server.post("/v1/completions", body, key=None)[0] == 401
    assert server.post("/v1/completions", {**body, "attention": {"features": ["nope"]}}, key="wrong")[0] == 401


BAD = {
    "not an object": ("[1, 2]", "attention"),
    "no features": ({"features": []}, "attention.features"),
    "unknown feature": ({"features": ["entropy", "import os"]}, "attention"),
    "unknown field": ({"features": ["sink"], "rows_": "all"}, "attention.rows_"),
    "layer out of range": ({"features": ["sink"], "layers": [0, 30]}, "attention.layers.1"),
    "head out of range": ({"features": ["sink"], "heads": [-10]}, "attention.heads.0"),
    "a layer twice": ({"features": ["sink"], "layers": [1, -29]}, "attention.layers"),
    "rows": ({"features": ["sink"], "rows": "some"}, "attention.rows"),
    "top_k": ({"features": ["top_keys"], "top_k": 0}, "attention.top_k"),
    "span_mass without spans": ({"features": ["span_mass"]}, "attention"),
    "two kinds": ({"features": ["span_mass"], "spans": [{"tokens": [0, 2], "chars": [0, 2]}]}, "attention.spans.0"),
    "an empty span": ({"features": ["span_mass"], "spans": [{"tokens": [3, 3]}]}, "attention.spans.0"),
    "tokens past the prompt": ({"features": ["span_mass"], "spans": [{"tokens": [0, 400]}]}, "attention.spans.0"),
    "chars past the prompt": ({"features": ["span_mass"], "spans": [{"chars": [0, 400]}]}, "attention.spans.0"),
    "a message on completions": ({"features": ["span_mass"], "spans": [{"message": 0}]}, "attention.spans.0"),
    "encoding": ({"features": ["sink"], "encoding": "npy"}, "attention.encoding"),
    "over the budget": ({"features": ["pattern"], "rows": "all"}, "attention"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_attention_gets_400_naming_the_field(server, case):
    attention, param = BAD[case]
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 200}
    data = (
        json.dumps(body)[:-1] + f', "attention": {attention if isinstance(attention, str) else json.dumps(attention)}}}'
    )
    status, found = server.post("/v1/completions", data.encode())
    assert status == 400, found
    assert found["error"]["param"] == param and found["error"]["code"] == 400
    assert found["error"]["message"].startswith(param)


def test_malformed_json_and_a_bad_message_span_on_chat(server):
    status, found = server.post("/v1/completions", b'{"prompt": "x", "attention": {"features": [')
    assert status == 400 and found["error"]["code"] == 400  # vLLM's own answer to JSON it cannot read
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    body["attention"] = {"features": ["span_mass"], "spans": [{"message": 3}]}
    status, found = server.post("/v1/chat/completions", body)
    assert (
        status == 400 and found["error"]["param"] == "attention.spans.0" and "out of range" in found["error"]["message"]
    )


# --- load and leaving clients -----------------------------------------------------------------------------------------


def _stream_and_leave(server: Server, chunks: int) -> None:
    """A streamed request with attention whose client reads `chunks` events and closes the connection."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True, "attention": {"features": ["entropy", "top_keys"], "layers": [0, 1, 2]}}  # fmt: skip
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    connection.request("POST", "/v1/completions", json.dumps(body), headers)
    response = connection.getresponse()
    assert response.status == 200
    for _ in range(chunks):
        response.fp.readline()
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()


def _wait_until_nothing_held(server: Server, seconds: float = 60) -> list[dict]:
    deadline = time.monotonic() + seconds
    while True:
        held = server.held()
        if all(rank.get("requests", 0) == 0 for rank in held) or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def test_a_client_that_leaves_mid_stream_frees_its_request(server):
    _stream_and_leave(server, chunks=6)
    held = _wait_until_nothing_held(server)
    assert all(rank.get("requests", 0) == 0 for rank in held), held
    assert server.completion({"features": ["sink"]})["attention"][0]["arrays"]  # still serving


def _server_memory(server: Server) -> int:
    import psutil

    root = psutil.Process(server.process.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def test_soak_a_bounded_mix_of_clients(server):
    """SOAK requests (400; `ATTNLENS_SOAK` sets another count, by hand: 2,000) from 8 threads, a mix of plain,
    attention, streamed, malformed and leaving clients, at most 0.6 s a request (4 minutes for 400): the server
    answers throughout, every valid greedy request's numbers equal the reference's, nothing is held after, and the
    server's resident memory grows by under 64 MiB from the first half to the end."""
    attention = {"features": ["entropy", "sink", "top_keys"], "layers": [0, 7, 29]}
    reference = client.numbers(server.completion(attention, max_tokens=6))[0]
    kinds = ["plain", "attention", "stream", "malformed", "leave"]
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + 0.6 * SOAK
    memory = {}

    def one(i: int) -> None:
        kind = kinds[i % len(kinds)]
        if kind == "plain":
            found = server.completion(max_tokens=6)
            ok = "attention" not in found
        elif kind == "attention":
            found = client.numbers(server.completion(attention, max_tokens=6))[0]
            ok = found.positions == reference.positions and all(
                torch.allclose(found.arrays[n].float(), reference.arrays[n].float(), atol=1e-5, equal_nan=True)
                for n in reference.arrays
            )
        elif kind == "stream":
            chunks = list(
                server.openai().completions.create(
                    model=server.model, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                    extra_body={"attention": attention},
                )
            )  # fmt: skip
            found = client.numbers(chunks)[0]
            ok = found.positions == reference.positions and torch.allclose(
                found.arrays["entropy"], reference.arrays["entropy"], atol=1e-5
            )
        elif kind == "malformed":
            status, _ = server.post("/v1/completions", {"model": server.model, "prompt": PROMPT, "attention": {"x": 1}})
            ok = status == 400
        else:
            _stream_and_leave(server, chunks=3)
            ok = True
        if not ok:
            with lock:
                errors.append(f"request {i} ({kind}) wrong")

    def worker(start: int) -> None:
        for i in range(start, SOAK, 8):
            if time.monotonic() > deadline:
                return
            if i == SOAK // 2:
                memory["half"] = _server_memory(server)
            try:
                one(i)
            except Exception as error:  # noqa: BLE001  gathered and reported
                with lock:
                    errors.append(f"request {i}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=worker, args=(start,)) for start in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors[:5]
    held = _wait_until_nothing_held(server)
    assert all(rank.get("requests", 0) == 0 and rank.get("bytes", 0) == 0 for rank in held), held
    grown = _server_memory(server) - memory["half"]
    print(f"soak: resident memory grew {grown / 2**20:.1f} MiB from request {SOAK // 2} to the end of {SOAK}")
    assert grown < 64 * 2**20


def test_the_page_runs(server, tmp_path):
    """docs/serve.md's ```python serve blocks, in order in one namespace, against this server; `# expected` lines
    after a print are checked."""
    import re

    page = Path(__file__).resolve().parent.parent / "docs" / "serve.md"
    blocks = re.findall(r"```python serve\n(.*?)```", page.read_text(), re.S)
    assert blocks
    namespace = {"BASE_URL": server.url, "API_KEY": KEY, "MODEL": server.model}
    for block in blocks:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(compile(block, str(page), "exec"), namespace)
        printed = [line.strip() for line in buffer.getvalue().splitlines()]
        lines = block.splitlines()
        for i, line in enumerate(lines[:-1]):
            if line.lstrip().startswith("print(") and lines[i + 1].startswith("# "):
                assert lines[i + 1][2:].strip() in printed, (lines[i + 1], printed)


def test_sigterm_drains_requests_in_flight(server):
    """Last (the module's server goes): a streamed request in flight when the server gets SIGTERM still completes
    (`attnlens serve` drains for 30 s where vLLM's default aborts), and the server exits. Its numbers come with it,
    or, for the rows not taken before vLLM's engine began to drain (a draining engine refuses the calls that take
    them), the choice's `error` says so: nothing is silently missing."""
    result = {}

    def request() -> None:
        stream = server.openai().completions.create(
            model=server.model, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
            extra_body={"attention": {"features": ["entropy"], "layers": [0, 1]}, "ignore_eos": True},
        )  # fmt: skip
        result["chunks"] = list(stream)

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(1.0)
    os.kill(server.process.pid, signal.SIGTERM)
    thread.join(120)
    assert server.process.wait(120) is not None
    chunks = result["chunks"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    found = client.numbers(chunks)[0]
    assert found.positions == list(range(found.prompt_tokens - 1, found.prompt_tokens - 1 + len(found.positions)))
    assert found.arrays["entropy"].shape == (2, 9, len(found.positions))
    assert len(found.positions) == 40 or found.error.startswith("these rows' numbers were not taken"), found.error
