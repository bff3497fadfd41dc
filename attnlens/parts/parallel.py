"""Parallel blocks (Phi, GPT-J, GPT-NeoX, Cohere, Falcon): attention and the MLP both read the block input, and the
block adds both outputs to it at once, so there is no residual stream between them."""

from __future__ import annotations

from ..locations import Location

#: Why a parallel block has no `layer_mid`.
PARALLEL_NO_MID = (
    "a parallel block: attention and the MLP both read the block input (through {norms}) and the "
    "block adds both outputs to it at once, so no residual stream exists between attention and the "
    "MLP; layer_input + attention_output + mlp_output == layer_output"
)


def parallel_locations(locations: dict[str, Location], mlp_norm_output: Location) -> dict[str, Location]:
    """A parallel block's locations from a sequential one's: no `layer_mid`, the MLP's norm output at `mlp_norm_output`
    (kept at its place in forward order)."""
    return {
        name: (mlp_norm_output if name == "mlp_norm_output" else location)
        for name, location in locations.items()
        if name != "layer_mid"
    }


def shared_attention_norm(family, config, layer) -> str:
    """A `kind_notes` note for mlp_norm_output where the MLP reads the attention's norm."""
    return shared_norm_note(family.attention_norm)


def shared_norm_note(norm: str) -> str:
    return (
        f"a parallel block: attention and the MLP read the same {norm} output, so this is that tensor as the MLP "
        f"receives it (equal to attention_norm_output; assigning it changes only the MLP's input)"
    )
