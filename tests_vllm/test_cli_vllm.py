"""`attnlens support --engine vllm` through the command line's own function (tests/cli_run.py; tests/test_cli.py runs
the entry point in a process of its own). The main suite's CLI tests run on the newest transformers only, whose
environment has no vLLM (tests/test_cli.py checks the refusal there), so the served engine is checked here."""

from tests.cli_run import attnlens


def test_support_on_the_vllm_engine():
    run = attnlens("support", "tiny:llama", "--engine", "vllm", "--layer", "1")
    assert run.returncode == 0, run.stderr
    assert "Llama · layer 1 · vllm" in run.stdout and "rebuilt in vLLM's worker" in run.stdout


def test_support_on_the_vllm_engine_after_an_engine_ran_in_this_process(llama):
    """A second engine's model built in one process (here on the meta device, as `support` builds it) makes the
    process's parallel groups again; nnsight's meta device once reached their rank lists, and the build failed."""
    assert llama.vllm is not None  # an engine has run in this process
    run = attnlens("support", "tiny:llama", "--engine", "vllm", "--layer", "1")
    assert run.returncode == 0, run.stderr
