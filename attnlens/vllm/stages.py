"""Pipeline parallelism: what an engine split into pipeline stages serves, and its ranks' results joined.

Under `pipeline_parallel_size=N` each of vLLM's stages builds its own run of blocks (a placeholder for every other
stage's: `blocks.held`), so its worker taps, records and reduces those blocks only: static captures, `collect`'s and
`head_summaries`' reductions and the server's rows are computed on the stage holding each layer, and only their
numbers reach the client, which joins the stages' layers (`by_stage`). A trace is refused: nnsight runs every trace
body on every worker, and a body reading a block another stage holds would wait for a value that never comes there.
`support()` serves what the attention op hands off, as on a compiled engine (`static.CompiledMode`), and says why
not for the rest.
"""

from __future__ import annotations

#: Why a pipelined engine serves no value to a trace, and what reads them there instead.
NO_TRACES = (
    "this engine runs {stages} pipeline stages (pipeline_parallel_size={stages}); nnsight runs a trace's body on "
    "every worker, and each stage holds only its own blocks, so a trace cannot read or edit them; read attention "
    "there with static_points (model.static_generate), attnlens.collect, attnlens.head_summaries or attnlens serve, "
    "or trace an engine on one stage (tensor_parallel_size to spread a model over devices)"
)


def by_stage(per_rank: list, stages: int) -> list[list]:
    """`collective_rpc`'s answers (vLLM's rank order: stage by stage, each stage's tensor-parallel ranks in turn)
    grouped by pipeline stage."""
    width = len(per_rank) // stages
    return [per_rank[stage * width : (stage + 1) * width] for stage in range(stages)]
