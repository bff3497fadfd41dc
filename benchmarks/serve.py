"""What answering `attention` costs a served model: `attnlens serve` against plain vLLM's server, side by side.

    python benchmarks/serve.py [--clients 32] [--requests 64] [--tokens 32] [--repeats 5]

Two servers on SmolLM2-135M float32, started by this script on 127.0.0.1 with the same vLLM arguments (its defaults:
compiled model, prefix caching, chunked prefill): vLLM's own (`vllm.entrypoints.launchers.api_server.entry`) and
`attnlens serve`. Each round sends `--requests` completions (greedy, `--tokens` tokens each, ignore_eos) from
`--clients` concurrent clients on loopback, four ways in turn: to plain vLLM; to attnlens serve without `attention`;
to attnlens serve asking entropy, sink and top keys of every layer for the generated tokens, as JSON numbers and as
base64 float16. The clients check each response holds its numbers without parsing them: on this machine they share
the server's two cores, and Python's `json.loads` of one response's 100,000 numbers (800 kB) takes 34 ms, where the
server writes them in 9 ms. Each row's figure is the median over rounds of its throughput (generated tokens per
second) as a ratio to plain vLLM's in the same round, with the latencies (p50, p99 of a request, over every round)
beside; a round's time on this shared machine moves 10-20%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_capture import PROMPTS, say

import attnlens

ATTENTION = {"features": ["entropy", "sink", "top_keys"], "rows": "generated"}
ATTENTION_BASE64 = {**ATTENTION, "encoding": "base64", "dtype": "float16"}
ARGS = ["--dtype", "float32", "--max-model-len", "512", "--served-model-name", "smollm2", "--seed", "0"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = _port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(port), *ARGS],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[:4]} exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return process, url
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"{command[:4]} did not answer in 900 s")


async def load(url: str, clients: int, requests: int, tokens: int, attention: dict | None) -> tuple[float, list]:
    """`requests` completions from `clients` concurrent clients: (seconds, each request's latency)."""
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    latencies: list[float] = []

    async def client(http) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            body = {"model": "smollm2", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0}
            body["ignore_eos"] = True
            if attention:
                body["attention"] = attention
            start = time.perf_counter()
            response = await http.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            if attention:  # not parsed: a client on this machine reading 100,000 JSON numbers takes the server's cores
                assert b'"attention"' in response.content and b'"error"' not in response.content, response.text[:500]
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return time.perf_counter() - start, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--logs", default="/tmp/attnlens-serve-benchmark")
    options = parser.parse_args()
    logs = Path(options.logs)
    logs.mkdir(parents=True, exist_ok=True)
    folder = str(attnlens.models.smollm2_path())
    vllm = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", folder]
    ours = [sys.executable, "-m", "attnlens", "serve", folder]
    servers = {}
    try:
        for name, command in (("plain vLLM", vllm), ("attnlens serve", ours)):
            started = time.perf_counter()
            servers[name] = start(command, logs / f"{name.replace(' ', '-')}.log")
            say(f"started {name} in {time.perf_counter() - started:.0f} s")
        rows = {
            "plain vLLM": (servers["plain vLLM"][1], None),
            "attnlens serve, no attention": (servers["attnlens serve"][1], None),
            "attnlens serve, entropy+sink+top_keys, every layer": (servers["attnlens serve"][1], ATTENTION),
            "  the same, base64 float16": (servers["attnlens serve"][1], ATTENTION_BASE64),
        }
        seconds = {name: [] for name in rows}
        latencies = {name: [] for name in rows}
        for round in range(options.repeats + 1):  # round 0 warms up
            for name, (url, attention) in rows.items():
                took, each = asyncio.run(load(url, options.clients, options.requests, options.tokens, attention))
                if round:
                    seconds[name].append(took)
                    latencies[name] += each
            say(f"round {round}/{options.repeats}: " + ", ".join(f"{s[-1]:.2f}" for s in seconds.values() if s) + " s")
    finally:
        for process, _ in servers.values():
            os.killpg(process.pid, signal.SIGTERM)
        for process, _ in servers.values():
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
    tokens = options.requests * options.tokens
    print(
        f"\n{options.requests} requests x {options.tokens} tokens, {options.clients} clients, {options.repeats} rounds"
    )
    print(f"{'':52} {'tokens/s':>9} {'ratio':>7} {'quartiles':>13} {'p50 s':>7} {'p99 s':>7}")
    base = seconds["plain vLLM"]
    found = {}
    for name in rows:
        ratios = [b / s for b, s in zip(base, seconds[name])]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        ordered = sorted(latencies[name])
        p50, p99 = ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        rate = tokens / statistics.median(seconds[name])
        found[name] = {"tokens_per_s": rate, "ratio": statistics.median(ratios), "p50_s": p50, "p99_s": p99}
        print(f"{name:52} {rate:9.0f} {statistics.median(ratios):7.3f} {q[0]:6.3f}-{q[2]:.3f} {p50:7.2f} {p99:7.2f}")
    print(json.dumps(found))


if __name__ == "__main__":
    main()
