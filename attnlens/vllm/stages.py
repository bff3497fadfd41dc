"""Pipeline parallelism: what an engine split into pipeline stages serves, and its ranks' results joined.

Under `pipeline_parallel_size=N` each of vLLM's stages builds its own run of blocks (a placeholder for every other
stage's: `blocks.held`), so its worker taps, records and reduces those blocks only: static captures, `collect`'s and
`head_summaries`' reductions and the server's rows are computed on the stage holding each layer, and only their
numbers reach the client, which joins the stages' layers (`by_stage`). A trace is refused: nnsight runs every trace
body on every worker, and a body reading a block another stage holds would wait for a value that never comes there.
`support()` serves what the attention op hands off, as on a compiled engine (`static.CompiledMode`), and says why
not for the rest. Attribution, on an engine built eagerly, runs a body of attnlens's own that reads on each stage
only that stage's blocks (`stage_aware`, `analysis.vllm`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Why a pipelined engine serves no value to a trace, and what reads them there instead.
NO_TRACES = (
    "this engine runs {stages} pipeline stages (pipeline_parallel_size={stages}); nnsight runs a trace's body on "
    "every worker, and each stage holds only its own blocks, so a trace cannot read or edit them; read attention "
    "there with static_points (model.static_generate), attnlens.collect, attnlens.head_summaries, attnlens serve or "
    "attnlens.attribution (on an engine built with enforce_eager=True), or trace an engine on one stage "
    "(tensor_parallel_size to spread a model over devices)"
)
#: Why attribution is not served on a pipelined engine at vLLM's compiled defaults.
ATTRIBUTION_COMPILED = (
    "attribution on pipeline stages reads each block's residual stream, inside vLLM's compiled graph on this "
    "engine; build it with StandardizedVLLM(..., pipeline_parallel_size=N, enforce_eager=True)"
)


@contextmanager
def stage_aware(model: Any) -> Iterator[None]:
    """Within the block, a trace on a pipelined engine runs, with every value its family serves on one stage: for
    attnlens's own bodies that read only the blocks the stage they run on holds (`analysis.vllm`: attribution), and
    keep what they compute in the worker for the client to join (nnsight reports the first stage's saves only)."""
    mode, model.access.mode, model.stage_aware = model.access.mode, None, True
    model.access.refresh()
    try:
        yield
    finally:
        model.access.mode, model.stage_aware = mode, False
        model.access.refresh()


def by_stage(per_rank: list, stages: int) -> list[list]:
    """`collective_rpc`'s answers (vLLM's rank order: stage by stage, each stage's tensor-parallel ranks in turn)
    grouped by pipeline stage."""
    width = len(per_rank) // stages
    return [per_rank[stage * width : (stage + 1) * width] for stage in range(stages)]
