"""What the load-time verification of a family costs (attnlens/verification.py), against a plain forward.

    python benchmarks/verification.py [--rounds 7]

On SmolLM2-135M (the bundled checkpoint, loaded once) and on `attnlens.toys.gated_toy_model()`, in alternation: the
path and size resolution every family gets at load, the verifying forward a family attnlens does not ship gets (6
tokens, the representative layers' values read and their identities run), a plain 6-token forward of the same model,
and wrapping the loaded model without the forward (`verify=False`). Reports the median of each over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import attnlens
from attnlens import verification
from attnlens.toys import gated_toy_model


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def gated_family():
    """The gated toy's family, as tests/test_verification.py writes it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_verification import Gated

    return Gated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    rounds = parser.parse_args().rounds
    warnings.simplefilter("ignore")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = attnlens.models.smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    smollm2 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    toy, family = gated_toy_model(), gated_family()
    cases = {
        "SmolLM2-135M": (smollm2, tokenizer, None),
        "gated toy": (toy, attnlens.models.char_tokenizer(), family),
    }
    ids = torch.randint(3, 100, (1, verification.TOKENS), generator=torch.Generator().manual_seed(0))
    for name, (inner, tok, fam) in cases.items():
        line = ", ".join(
            f"{what} {1000 * statistics.median(t):.0f} ms" for what, t in measured(inner, tok, fam, ids, rounds)
        )
        print(f"{name}: {line} (medians of {rounds})")


def measured(inner, tokenizer, family, ids, rounds: int) -> list[tuple[str, list[float]]]:
    """Each step's times over `rounds` alternating rounds."""
    model = attnlens.StandardizedTransformer(inner, tokenizer=tokenizer, family=family, verify=False)
    steps = {
        "resolve": lambda: verification.resolve(model),
        "verify": lambda: verification.verify(model),
        "plain forward": lambda: inner(ids),
        "wrap, verify=False": lambda: attnlens.StandardizedTransformer(
            inner, tokenizer=tokenizer, family=family, verify=False
        ),
    }
    times: dict[str, list[float]] = {what: [] for what in steps}
    for _ in range(rounds):
        for what, step in steps.items():
            with torch.no_grad():
                times[what].append(timed(step))
    return list(times.items())


if __name__ == "__main__":
    main()
