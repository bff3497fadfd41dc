"""Lfm2 (attnlens/families/lfm2.py): what the shared identities cannot see."""

import pytest

import attnlens
from attnlens.families.lfm2 import Lfm2
from attnlens.locations import Operation
from attnlens.models import char_tokenizer, tiny_model


def test_a_moved_mlp_operation_fails_the_load():
    class Moved(Lfm2):
        def locations(self):
            return {**super().locations(), "mlp_activation": Operation(("F_silu_1",), anchor="F.silu")}

    with pytest.raises(attnlens.LocationDrift, match=r"Moved, value mlp_activation: .*Lfm2MLP\.forward"):
        attnlens.StandardizedTransformer(tiny_model("lfm2"), tokenizer=char_tokenizer(), family=Moved)
