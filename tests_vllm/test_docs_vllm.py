"""docs/vllm.md runs: its ```python vllm blocks execute in order in one namespace (the main suite's docs test skips
them), against this session's SmolLM2 engine rather than a second one. `# expected` lines after a print are checked."""

import contextlib
import io
import pathlib
import re

import attnlens

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "vllm.md"
BLOCK = re.compile(r"```python vllm\n(.*?)```", re.S)


def test_vllm_page_runs(smollm2, monkeypatch, tmp_path):
    build = attnlens.StandardizedVLLM  # a static engine (static_points) is built for real; others are the session's
    monkeypatch.setattr(
        attnlens,
        "StandardizedVLLM",
        lambda path, **kwargs: build(path, **kwargs) if "static_points" in kwargs else smollm2.vllm,
        raising=False,
    )
    namespace = {"__name__": "docs_vllm"}
    blocks = BLOCK.findall(PAGE.read_text())
    assert blocks
    for number, block in enumerate(blocks):
        script = tmp_path / f"vllm_{number}.py"  # nnsight reads a trace's body back from its file
        script.write_text(block)
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(compile(block, str(script), "exec"), namespace)
        printed = buffer.getvalue().splitlines()
        lines = block.splitlines()
        for i, line in enumerate(lines[:-1]):
            if line.lstrip().startswith("print(") and lines[i + 1].startswith("# "):
                assert lines[i + 1][2:].strip() in [p.strip() for p in printed], (lines[i + 1], printed)
