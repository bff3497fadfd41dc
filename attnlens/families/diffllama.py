"""DiffLlama: differential attention, two softmax patterns subtracted per head pair, then a per-pair RMS norm.

Every one of the `num_heads` query heads has an ordinary softmax pattern over its queries and keys (rotary, grouped,
scaled by `head_dim ** -0.5`): `attention_scores` and `attention_probabilities` are those, exactly. The forward runs
the attention function twice with the same queries, keys and pattern, once on each half of the key/value heads'
values (`torch.chunk(value_states, 2, dim=1)`, each repeated back to `num_kv_heads` heads), and concatenates the two
mixes, so each head mixes values twice `head_dim` wide: key/value head `g` carries `[v_g' | v_{g' + kv/2}]`,
`g' = g mod kv/2`. `attention_values` is that doubled value (a read-only copy assembled from `value_states`) and
`attention_head_outputs` the concatenated mix, `pattern @ values` per head (`head_dim` is twice the queries').

The differential combination pairs head `j` with head `j + num_heads / 2`: `(1 - lambda_init) * groupnorm(out_j -
lambda * out_{j + num_heads/2})`, with `lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`, merged to
`num_heads * head_dim` for `o_proj` (`merge_heads` does exactly this). The differential pattern `P_j - lambda *
P_{j + num_heads/2}` is never formed and is not served.
"""

import torch

from ..family import Family, Tiny, VLLMLayout
from ..locations import Derived, Operation
from ..parts import identities
from ..parts.sizes import Sizes
from ..parts.vllm import backend_refuses, no_dispatch

SECOND_CALL = (
    "the forward runs the attention function twice with the same queries, keys and pattern (once per half "
    "of the values)"
)


def _doubled(envoy, values):
    # [b, kv, s, d] -> [b, kv, s, 2d]: each kv head's two halves side by side, as the two calls' values concatenate
    first, second = values.chunk(2, dim=1)
    return torch.cat([first, second], dim=-1).repeat(1, 2, 1, 1)


def _same(envoy, tensor):
    return tensor


def _first_call_only(location, label, what):
    return Derived(
        location,
        _same,
        None,
        label,
        in_place=False,
        why_not=f"{SECOND_CALL}; {what} is the first call's, so an edit would reach only the first half "
        f"of every head's output",
    )


class DiffLlama(Family):
    model_types = ("diffllama",)
    vllm = VLLMLayout(
        refusal=backend_refuses(
            "DiffLlama",
            no_dispatch("0"),
        )
    )
    tiny = Tiny("DiffLlamaConfig", "DiffLlamaForCausalLM", {"head_dim": 16})
    sizes = Sizes(head_dim=(lambda module, found: 2 * module.head_dim,), qk_head_dim=("head_dim",))

    def locations(self):
        locations = super().locations()
        keys = Derived(
            locations["attention_keys"],
            _same,
            None,
            "attention_keys",
            in_place=True,
            why_not=f"{SECOND_CALL}; assigning the first call's keys would leave the second call's alone "
            f"(in-place edits reach both: it is one tensor)",
        )
        values = Derived(
            Operation(("torch_chunk_0",), "arg", 0, anchor="torch.chunk(value_states, 2, dim=1)"),
            _doubled,
            None,
            "attention_values",
            in_place=False,
            why_not="it is assembled from value_states: the forward never holds a head's doubled "
            "values as one tensor; edit the values through v_proj's output instead",
        )
        heads = {
            # the values are split before the first call, so they come before the keys the call receives
            "attention_queries": Operation(("apply_rotary_pos_emb_0",), item=0, anchor="apply_rotary_pos_emb("),
            "attention_values": values,
            "attention_keys": keys,
            "attention_scores": _first_call_only(locations["attention_scores"], "attention_scores", "the scores"),
            "attention_probabilities": _first_call_only(
                locations["attention_probabilities"], "attention_probabilities", "the pattern"
            ),
            "attention_head_outputs": Operation(("attn_output_0",), anchor="torch.cat([attn_output1, attn_output2]"),
        }
        ordered = {}
        for name, location in locations.items():
            if name == "attention_queries":
                ordered.update(heads)
            elif name not in heads:
                ordered[name] = location
        return ordered

    @staticmethod
    def lambda_full(module, dtype):
        def part(q, k):
            return torch.exp(torch.sum(q * k, dim=-1, dtype=torch.float32)).to(dtype)

        return part(module.lambda_q1, module.lambda_k1) - part(module.lambda_q2, module.lambda_k2) + module.lambda_init

    class Identities(identities.Identities):
        def merge_heads(self, module, heads):
            first, second = heads.chunk(2, dim=2)
            mixed = first - self.family.lambda_full(module, heads.dtype) * second
            return ((1 - module.lambda_init) * module.groupnorm(mixed)).reshape(*heads.shape[:2], -1)

    kind_notes = {
        "*": {
            "attention_probabilities": lambda family, config, layer: (
                f"each query head's own softmax pattern; differential head j (j < "
                f"{(half := config.num_attention_heads // 2)}) outputs (P_j - lambda * P_(j+{half})) @ values, a "
                f"difference never formed as a tensor. A read-only copy: {SECOND_CALL}"
            ),
            "attention_values": "each key/value head's values twice head_dim wide: [v_g | v_(g + kv/2)] for g mod "
            "kv/2, as the two attention calls mix them; a read-only copy",
            "attention_head_outputs": "pattern @ values per head, 2 x head_dim wide: the two attention calls' "
            "outputs concatenated, before the differential combination",
            "attention_premix": lambda family, config, layer: (
                f"(1 - lambda_init) * groupnorm(out_j - lambda * out_(j+{(half := config.num_attention_heads // 2)})) "
                f"for each of the {half} head pairs, merged: what o_proj receives"
            ),
        }
    }
