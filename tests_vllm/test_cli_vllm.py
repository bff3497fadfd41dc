"""`attnlens support --engine vllm` as a user runs it (a subprocess). The main suite's CLI tests run on the newest
transformers only, whose environment has no vLLM (tests/test_cli.py checks the refusal there), so the served engine
is checked here."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_support_on_the_vllm_engine():
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "ATTNLENS_CACHE": os.environ.get("ATTNLENS_CACHE") or str(pathlib.Path.home() / ".cache" / "attnlens"),
    }
    run = subprocess.run(
        [sys.executable, "-m", "attnlens", "support", "tiny:llama", "--engine", "vllm", "--layer", "1"],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "Llama · layer 1 · vllm" in run.stdout and "rebuilt in vLLM's worker" in run.stdout
