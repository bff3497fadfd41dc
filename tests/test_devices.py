"""Every tensor attnlens makes is made on the device it will meet.

On a GPU, a mask or a position built on the CPU breaks every rebuilt pattern, and no CPU run shows it (the H200 sweep
found exactly that). So while `DeviceDiscipline` is on, a tensor factory called from attnlens's own code without
`device=` raises, naming the line; every family's reads, rebuilt patterns, capture, generation and head summaries run
under it here. Code that prepares inputs on the host (token ids, the viewer's bytes, the command line) is exempt.
"""

import sys
from pathlib import Path

import pytest
import torch
from conftest import ALL_CASES, PROMPT, tiny
from torch.overrides import TorchFunctionMode

import attnlens
from attnlens import checks
from attnlens.models import char_tokenizer, tiny_model

PACKAGE = Path(attnlens.__file__).parent
FACTORIES = {
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.tensor,
    torch.eye,
    torch.linspace,
    torch.rand,
    torch.randn,
    torch.randint,
}
#: Host-side code: token ids, the viewer's bytes and the command line.
HOST = {"capture/runs.py", "show.py", "plot.py", "cli.py", "models.py", "heads.py"}


class DeviceDiscipline(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            frame = sys._getframe(1)
            path = Path(frame.f_code.co_filename)
            if PACKAGE in path.parents:
                where = path.relative_to(PACKAGE).as_posix()
                if where not in HOST:
                    raise AssertionError(
                        f"attnlens/{where}:{frame.f_lineno} makes a tensor with {func.__name__}() "
                        f"without device=: on a GPU it lands on the CPU"
                    )
            self.calls += 1
        return func(*args, **kwargs)


def sdpa(case):
    try:
        return attnlens.StandardizedTransformer(
            tiny_model(case, attn_implementation="sdpa"), tokenizer=char_tokenizer(), rebuild_patterns=True
        )
    except ValueError:  # transformers runs this family eager only
        return None


def test_the_guard_catches_a_factory_without_a_device():
    """The mask as it was built before the GPU sweep found it: `torch.arange(num_keys)` in family.py."""
    before = compile("torch.arange(3)", str(PACKAGE / "family.py"), "exec")
    with pytest.raises(AssertionError, match=r"attnlens/family.py:1 makes a tensor with arange\(\) without device"):
        with DeviceDiscipline():
            exec(before, {"torch": torch})


@pytest.mark.parametrize("case", ALL_CASES)
def test_reads_rebuilds_capture_and_generation_make_tensors_on_the_models_device(case):
    model = tiny(case)
    layers = [i for i in range(model.num_layers) if model.support(i)["self_attn.attention_probabilities"] is None]
    with DeviceDiscipline(), torch.no_grad():
        with model.trace(PROMPT):
            read = list().save()
            for i in layers:
                attn = model.layers[i].self_attn
                values = attn.attention_values if model.family.score_function().scores_need_values else None  # Doge
                read.append((attn.attention_queries, attn.attention_keys, values, attn.attention_probabilities))
        for i, (queries, keys, values, probabilities) in zip(layers, read):
            extra = {"values": values} if values is not None else {}
            scores = model.family.score_function().scores(
                model.layers[i].self_attn.heads, model.config, queries, keys, i, **extra
            )
            assert scores.shape == probabilities.shape
            assert checks.visible(model.config, model.family, i, keys.shape[2], keys.device).shape[-1] == keys.shape[2]
        attn = model.layers[layers[0]].self_attn
        with model.generate(PROMPT, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0) as tracer:
            for _ in tracer.iter[:2]:
                attn.attention_key_positions.save()
        rebuilding = sdpa(case)
        if rebuilding is not None:
            rebuilt = [i for i in layers if rebuilding.support(i)["self_attn.attention_probabilities"] is None]
            if rebuilt:
                attnlens.capture_attention(rebuilding, [PROMPT, PROMPT[:7]], rebuilt, rows=[-1, 2], heads=[0, 1])
                attnlens.run_with_cache(rebuilding, PROMPT, [f"attn_probs.{rebuilt[-1]}"])
