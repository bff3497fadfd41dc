"""The `attnlens` command line: the entry point as a user runs it (`python -m attnlens` in a subprocess, an error's
exit status included), every other command through the same `cli.main` in this process (`cli_run`); the rarer errors
and every command's --help in this process too."""

import csv
import importlib.util
import io
import json
import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import tomllib
import torch
from cli_run import attnlens

from attnlens import cli

#: the same on every transformers: run on the newest one only (`make test-eager-vllm` deselects it); on one
#: worker under pytest-xdist (`--dist loadgroup`), so the module's `runs` is made once
pytestmark = [pytest.mark.any_transformers, pytest.mark.xdist_group("cli")]

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPTS = "Hello world, again\nThe cat sat on the mat\n\n"
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def commands(tmp: pathlib.Path) -> dict[str, tuple[list[str], str | None]]:
    """Name -> (arguments, stdin) of every run the tests below check."""
    (tmp / "prompts.txt").write_text(PROMPTS)
    (tmp / "empty.txt").write_text("\n\n")
    return {
        "families": (["families"], None),
        "support": (["support", "tiny:llama", "--layer", "1"], None),
        "page": (
            ["show", "tiny:llama", "Hello world", "--layer", "1,2", "--heads", "0-2", "--out", str(tmp / "page.html")],
            None,
        ),
        "png": (["show", "tiny:gemma3", "Hello world", "--layer", "0", "--out", str(tmp / "layer0.png")], None),
        "csv": (
            [
                "heads",
                "tiny:llama",
                "--prompts",
                str(tmp / "prompts.txt"),
                "--format",
                "csv",
                "--length",
                "10",
                "--sequences",
                "2",
            ],
            None,
        ),
        "json": (
            ["heads", "tiny:qwen3_next", "--prompts", "-", "--format", "json", "--length", "10", "--top-k", "2"],
            PROMPTS,
        ),
        "vllm": (["support", "tiny:llama", "--engine", "vllm", "--layer", "1"], None),
        # errors
        "unknown model": (["support", "no-such-model"], None),
        "layer out of range": (["show", "tiny:llama", "Hi", "--layer", "7", "--out", str(tmp / "x.html")], None),
        "bad heads": (
            ["show", "tiny:llama", "Hi", "--layer", "1", "--heads", "two", "--out", str(tmp / "x.html")],
            None,
        ),
    }


#: The runs made as a user makes them, a process each: the entry point, and an error's exit status through it.
IN_A_PROCESS = ("families", "unknown model")


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Every run of `commands`: those of IN_A_PROCESS in subprocesses (side by side), the rest in this process."""
    tmp = tmp_path_factory.mktemp("cli")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "ATTNLENS_CACHE": os.environ.get("ATTNLENS_CACHE") or str(pathlib.Path.home() / ".cache" / "attnlens"),
    }

    def run(item):
        args, stdin = item
        return subprocess.run(
            [sys.executable, "-m", "attnlens", *args],
            cwd=ROOT,
            env=env,
            text=True,
            input=stdin,
            capture_output=True,
            timeout=600,
            check=False,
        )

    planned = commands(tmp)
    with ThreadPoolExecutor(max_workers=len(IN_A_PROCESS)) as pool:
        started = {name: pool.submit(run, planned[name]) for name in IN_A_PROCESS}
        done = {name: attnlens(*args, stdin=stdin) for name, (args, stdin) in planned.items() if name not in started}
        done.update((name, future.result()) for name, future in started.items())
    done["tmp"] = tmp
    return done


def ok(run):
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_the_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"attnlens": "attnlens.cli:main"}


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and all(command in out for command in ("families", "support", "show", "heads"))
    for command in ("families", "support", "show", "heads"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--help"])
        assert exit_.value.code == 0 and f"usage: attnlens {command}" in capsys.readouterr().out


def test_families(runs):
    rows = {line.split("│")[1].strip(): line for line in ok(runs["families"]).splitlines() if line.count("│") > 4}
    assert "llama" in rows["Llama"].split("│")[4] and "tiny:llama" in rows["Llama"]
    assert "gpt2" in rows["GPT2"].split("│")[4] and rows["MPT"].split("│")[4].strip() == "-"  # vLLM refuses MPT
    from attnlens import registered

    built_in = {f.__name__ for f in registered().values() if f.__module__.startswith("attnlens.families.")}
    assert built_in <= set(rows)  # (families other tests register live in this process only)


def test_support(runs):
    out = ok(runs["support"])
    assert "Llama · layer 1 · transformers" in out and "self_attn.attention_probabilities" in out


def test_show_writes_a_page_and_a_png(runs):
    from test_show import page_data

    page = runs["tmp"] / "page.html"
    assert ok(runs["page"]).strip() == str(page)
    data = page_data(page.read_text())
    assert [layer["layer"] for layer in data["layers"]] == [1, 2] and data["layers"][0]["heads"] == [0, 1, 2]
    assert data["tokens"] == list("Hello world")
    png = runs["tmp"] / "layer0.png"
    assert ok(runs["png"]).strip() == str(png)
    from test_plot import read_png, spread

    assert spread(read_png(png)) > 20


def test_heads_in_every_format(runs):
    rows = list(csv.DictReader(io.StringIO(ok(runs["csv"]))))
    assert len(rows) == 3 * 4 and list(rows[0])[:4] == ["layer", "head", "entropy", "sink"]
    assert json.loads(rows[0]["top"])[1]["prompt"] == 1
    found = json.loads(ok(runs["json"]))
    assert set(found["skipped"]) == {"0", "2"} and "queries unavailable" in found["skipped"]["0"]  # linear attention
    assert {row["layer"] for row in found["heads"]} == {1} and len(found["heads"][0]["top"]) == 2


def test_vllm_engine(runs):
    # `make test` runs this file where vLLM is missing; tests_vllm/test_cli_vllm.py checks the served engine
    run = runs["vllm"]
    if HAS_VLLM:
        assert "Llama · layer 1 · vllm" in ok(run) and "rebuilt in vLLM's worker" in run.stdout
    else:
        assert run.returncode == 1 and "make install-vllm" in run.stderr


@pytest.mark.parametrize(
    ("name", "status", "message"),
    [
        ("unknown model", 1, "could not load 'no-such-model' as a hub name"),
        ("layer out of range", 1, r"layer 7 is out of range: this model has 3 layers"),
        ("bad heads", 2, "argument --heads: 'two' is not a list like"),
    ],
)
def test_errors_are_one_line(runs, name, status, message):
    run = runs[name]
    assert run.returncode == status
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"attnlens {run.args[3]}: error: "), run.stderr
    assert message in lines[0] and "Traceback" not in run.stderr and run.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["show", "tiny:llama", "Hi", "--layer", "1", "--heads", "9", "--out", "{tmp}/x.html"],
            "head 9 is out of range: there are 4",
        ),
        (["show", "tiny:llama", "Hi", "--layer", "1", "--out", "{tmp}/prompts.txt/x.html"], "no such folder"),
        (["show", "tiny:llama", "Hi", "--layer", "1", "--out", "{tmp}/x.jpg"], "write .html or .htm or .png"),
        (["show", "tiny:llama", "Hi", "--layer", "1,2", "--out", "{tmp}/x.png"], "a PNG shows one layer"),
        (["heads", "tiny:llama", "--prompts", "{tmp}/empty.txt"], "no prompts (one per line)"),
        (["heads", "tiny:llama", "--prompts", "{tmp}/missing.txt"], "No such file or directory"),
        (["heads", "tiny:llama", "--length", "100"], "longer than the model's 128 positions"),
        (["heads", "tiny:gpt_oss"], "no layer of this GptOss model can be summarised"),
        (["support", "tiny:nope"], "no tiny model 'nope': no family has that model type"),
        (["support", "./no/such/folder"], "no such folder: ./no/such/folder"),
    ],
)
def test_more_errors_in_process(tmp_path, capsys, args, message):
    (tmp_path / "prompts.txt").write_text(PROMPTS)
    (tmp_path / "empty.txt").write_text("\n\n")
    assert cli.main([arg.format(tmp=tmp_path) for arg in args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"attnlens {args[0]}: error: ") and message in err[0], err


def test_heads_table_to_a_file(tmp_path, capsys):
    out = tmp_path / "heads.txt"
    assert cli.main(["heads", "tiny:llama", "--layers", "2", "--length", "10", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    text = out.read_text()
    assert "induction" in text and text.count("\n│     2 │") == 4  # layer 2's four heads


def test_an_encoder_checkpoint_loads_as_an_encoder_and_a_decoder_as_a_decoder(tmp_path, capsys):
    """A folder holding a masked LM (BERT saved without is_decoder) is served by StandardizedEncoder, bidirectional;
    the same type saved as a causal LM by StandardizedTransformer."""
    import transformers

    from attnlens.models import char_tokenizer

    for name, is_decoder in (("encoder", False), ("decoder", True)):
        config = transformers.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=128,
            is_decoder=is_decoder,
        )  # fmt: skip
        model_class = transformers.BertLMHeadModel if is_decoder else transformers.BertForMaskedLM
        model_class(config).save_pretrained(tmp_path / name)
        char_tokenizer().save_pretrained(tmp_path / name)
        loaded = cli.load_model(str(tmp_path / name))
        assert type(loaded).__name__ == ("StandardizedTransformer" if is_decoder else "StandardizedEncoder")
        assert cli.main(["support", str(tmp_path / name)]) == 0
        notes = capsys.readouterr().out
        assert ("causal" if is_decoder else "bidirectional") in notes


@pytest.mark.skipif(HAS_VLLM, reason="checks the refusal where vLLM is missing (tests_vllm/test_serve.py serves)")
def test_serve_without_vllm_says_so():
    run = attnlens("serve", "smollm2", "--port", "8000")
    assert run.returncode == 1 and "attnlens serve needs vLLM" in run.stderr and "make install-vllm" in run.stderr


def _served_response(pattern: torch.Tensor, positions: list[int], ids: list[int], prompt_tokens: int) -> dict:
    """What `attnlens serve` answers a completion that asked for whole rows (`pattern`) and the token ids: one choice
    on layers 0 and 1, heads 0 and 2, JSON numbers."""
    arrays = {"pattern": {"shape": list(pattern.shape), "dtype": "float32", "data": pattern.tolist()}}
    entropy = torch.special.entr(pattern).sum(-1)
    arrays["entropy"] = {"shape": list(entropy.shape), "dtype": "float32", "data": entropy.tolist()}
    return {
        "model": "tiny",
        "choices": [
            {"index": 0, "text": "", "prompt_token_ids": ids[:prompt_tokens], "token_ids": ids[prompt_tokens:]}
        ],
        "attention": [
            {
                "index": 0,
                "layers": [0, 1],
                "heads": [0, 2],
                "positions": positions,
                "prompt_tokens": prompt_tokens,
                "spans": [],
                "arrays": arrays,
            }
        ],
    }


def test_show_draws_a_served_response(tmp_path):
    """`attnlens show --response`: each row of a served response's pattern at its position (the prompt's last row,
    then each generated one), the heads by their numbers, the tokens decoded from the response's ids with MODEL's
    tokenizer (numbers without it); a response without rows, or naming what it lacks, is refused saying so."""
    from test_show import page_data

    generator = torch.Generator().manual_seed(0)
    positions, width = [3, 4, 5], 6
    pattern = torch.rand(2, 2, 3, width, generator=generator)
    pattern = torch.where(torch.arange(width) <= torch.tensor(positions)[:, None], pattern, 0.0)
    pattern = pattern / pattern.sum(-1, keepdim=True)
    ids = [5, 9, 12, 7, 30, 31]
    (tmp_path / "response.json").write_text(json.dumps(_served_response(pattern, positions, ids, 4)))
    response = str(tmp_path / "response.json")

    page = tmp_path / "page.html"
    assert ok(attnlens("show", "tiny:llama", "--response", response, "--out", str(page))).strip() == str(page)
    data = page_data(page.read_text())
    assert [layer["layer"] for layer in data["layers"]] == [0, 1]
    tokenizer = cli._loading("tiny:llama").tokenizer
    assert data["tokens"] == [tokenizer.decode([token]) for token in ids]
    for i, layer in enumerate(data["layers"]):
        assert layer["heads"] == [0, 2] and layer["queries"] == positions and layer["keys"] == list(range(width))
        weights = layer["weights"]
        for r, position in enumerate(positions):
            assert torch.allclose(
                weights[:, r, : position + 1] ** 0.5, pattern[i, :, r, : position + 1] ** 0.5, atol=1 / 255
            )

    one = tmp_path / "one.html"
    assert ok(attnlens("show", "--response", response, "--layer", "1", "--heads", "2", "--out", str(one)))
    data = page_data(one.read_text())
    assert [layer["layer"] for layer in data["layers"]] == [1] and data["layers"][0]["heads"] == [2]
    assert data["tokens"] == [str(i) for i in range(width)]  # no MODEL: positions

    png = tmp_path / "one.png"
    assert ok(attnlens("show", "--response", response, "--layer", "0", "--out", str(png)))
    from test_plot import read_png, spread

    assert spread(read_png(png)) > 20

    refused = {
        "no pattern rows": (["--layer", "0"], "pattern", {"features": "entropy"}),
        "a layer it lacks": (["--layer", "5"], "not in this response", None),
        "a head it lacks": (["--heads", "1"], "not in this response", None),
        "another choice": (["--choice", "3"], "no choice 3", None),
        "a prompt too": (["Hello"], "no PROMPT", None),
    }
    for name, (extra, said, change) in refused.items():
        given = response
        if change:
            body = _served_response(pattern, positions, ids, 4)
            del body["attention"][0]["arrays"]["pattern"]
            (tmp_path / "rows.json").write_text(json.dumps(body))
            given = str(tmp_path / "rows.json")
        model = ["tiny:llama"] if name == "a prompt too" else []
        found = attnlens("show", *model, *extra, "--response", given, "--out", str(tmp_path / "x.html"))
        assert found.returncode == 1 and said in found.stderr, (name, found.stderr)
