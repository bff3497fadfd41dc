"""`attnlens attribute` and `attnlens patch` through the command line's own function (`cli_run`: tests/test_cli.py runs
the entry point in a process of its own), their errors included."""

import pytest
from cli_run import attnlens

#: the same on every transformers: run on the newest one only (`make test-eager-vllm` deselects it)
pytestmark = pytest.mark.any_transformers


def test_attribute(tmp_path):
    run = attnlens(
        "attribute",
        "tiny:llama",
        "Hello world, again",
        "--target",
        "a",
        "--versus",
        "b",
        "--out",
        str(tmp_path / "grid.png"),
    )
    assert run.returncode == 0, run.stderr
    assert "logit('a')" in run.stdout and "contribution" in run.stdout
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_patch(tmp_path):
    run = attnlens(
        "patch",
        "tiny:llama",
        "Hello world, again",
        "Jello world, agaim",
        "--target",
        "a",
        "--versus",
        "b",
        "--out",
        str(tmp_path / "grid.csv"),
    )
    assert run.returncode == 0, run.stderr
    assert "activation patching" in run.stdout
    assert (tmp_path / "grid.csv").read_text().splitlines()[0] == "layer,head,value,effect"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["attribute", "tiny:llama", "Hi", "--target", "ab"], "is 2 tokens"),
        (["patch", "tiny:llama", "Hello", "Hi", "--target", "a"], "same length"),
        (["attribute", "tiny:llama", "Hi", "--target", "a", "--row", "9"], "out of range"),
    ],
)
def test_errors(args, message):
    run = attnlens(*args)
    assert run.returncode == 1 and run.stderr.startswith(f"attnlens {args[0]}: error:") and message in run.stderr
    assert "Traceback" not in run.stderr
