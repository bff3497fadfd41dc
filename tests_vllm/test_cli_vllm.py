"""`attnlens support --engine vllm` through the command line's own function (tests/cli_run.py; tests/test_cli.py runs
the entry point in a process of its own). The main suite's CLI tests run on the newest transformers only, whose
environment has no vLLM (tests/test_cli.py checks the refusal there), so the served engine is checked here."""

from tests.cli_run import attnlens


def test_support_on_the_vllm_engine():
    run = attnlens("support", "tiny:llama", "--engine", "vllm", "--layer", "1")
    assert run.returncode == 0, run.stderr
    assert "Llama · layer 1 · vllm" in run.stdout and "rebuilt in vLLM's worker" in run.stdout
