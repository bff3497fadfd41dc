"""The inferred common layout (attnlens/inferred.py): every unregistered type the survey finds fitting is inferred,
serves the full vocabulary less what the survey drops, and passes every identity on every layer; models altered away
from the common layout are refused, naming the first check that fails."""

import json
import re

import pytest
import torch
import transformers
from conftest import PROMPT
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaRMSNorm,
    apply_rotary_pos_emb,
    eager_attention_forward,
    repeat_kv,
)

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.family import TINY_DEFAULTS, Family, UnknownLayout
from attnlens.inferred import CHECKS, Inferred, NotCommonLayout
from attnlens.registry import _REGISTERED
from attnlens.values import BY_NAME
from tools import ROOT, survey

RECORDS = json.loads(survey.JSON_PATH.read_text())["records"]  # transformers 5.24's: the full records
#: The unregistered types whose tiny model the survey finds fitting the common layout (its identities hold there).
FITS = [t for t, r in RECORDS.items() if survey.candidate(r)]
#: Types the survey's numeric probe fits but the static checks refuse, and why.
REFUSED = {
    # its attention may run a sparse block indexer that rewrites the mask (block_indices); the tiny model has none
    "minimax_m3_vl_text": "interface_call",
}
#: Every type the committed survey serves with the inferred layout, the survey's fits among them.
INFERRED = sorted({t for t, r in RECORDS.items() if (r.get("serves") or {}).get("inferred")} | set(FITS) - set(REFUSED))


def _build(model_type: str) -> torch.nn.Module:
    """The survey's tiny model of `model_type` on the installed transformers (skips where the type is absent)."""
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type!r} is not in transformers {transformers.__version__}")
    kwargs = survey.tiny_kwargs(model_type)
    if transformers.__version__ == json.loads(survey.JSON_PATH.read_text())["versions"]["transformers"]:
        assert json.loads(json.dumps(kwargs)) == RECORDS[model_type]["tiny_kwargs"]  # the survey's own model
    return survey.build(model_type)


def _load(inner: torch.nn.Module, **kwargs) -> attnlens.StandardizedTransformer:
    return attnlens.StandardizedTransformer(inner, tokenizer=attnlens.models.char_tokenizer(), **kwargs)


def _dropped(model_type: str) -> set[str]:
    """What the survey says the common layout leaves out of the type: the probe's drops where it fits, else the
    inferred family's."""
    record = RECORDS[model_type]
    dropped = record["common_layout"]["dropped"] if model_type in FITS else record["serves"]["dropped"]
    return {BY_NAME[name].key for name in dropped}


@pytest.mark.parametrize("model_type", INFERRED)
def test_inferred_serves_the_vocabulary_and_every_identity_holds(model_type):
    inner = _build(model_type)
    if model_type in attnlens.registered():  # a registered family wins; the inferred one is still checked here
        assert not isinstance(_load(inner).family, Inferred)
        model = _load(inner, family=Inferred(inner))
    else:
        with pytest.warns(attnlens.InferredFamilyWarning, match="@attnlens.register"):
            model = _load(inner)
    assert model.family.name == f"Inferred({inner.config.model_type})"  # emu3 builds its text model
    saved = read_everything(model, PROMPT)
    assert {layer: bad for layer in range(model.num_layers) if (bad := failures(model, saved, layer))} == {}
    never = {BY_NAME[name].key for name in Family.absent}  # no common-layout model has a sink or an output gate
    missing = {key for layer in model.family.attention_layers for key in model.support(layer).unavailable} - never
    assert missing == _dropped(model_type)
    assert "verified" in model.support(model.family.attention_layers[0]).notes["layer_input"]


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_survey_fits_the_static_checks_refuse(model_type):
    if model_type in attnlens.registered():  # a family serves it now, and the survey builds the family's recipe:
        # the recorded model (its full-attention layers) is still refused by the inferred layout
        recorded = RECORDS[model_type]["tiny_kwargs"]
        full = ["full_attention"] * recorded["num_hidden_layers"]
        with pytest.raises(NotCommonLayout, match=f"^{REFUSED[model_type]}:"):
            Inferred(survey.build(model_type, **{**recorded, "layer_types": full}))
        return
    with pytest.warns(attnlens.UnknownFamilyWarning, match=f"check {REFUSED[model_type]}:"):
        model = _load(_build(model_type))
    assert isinstance(model.family, UnknownLayout)
    assert f"refused ({REFUSED[model_type]}:" in model.support(0)["self_attn.attention_queries"]


def test_a_hybrid_serves_its_other_mixers_block_values_only():
    model = _load(_build("lara_mini"))
    report = model.support(0)  # a Gated DeltaNet layer
    assert report["self_attn.attention_probabilities"].startswith("layer 0's mixer is linear_attn")
    assert report["self_attn.attention_output"] is None and report["layer_mid"] is None
    assert "not softmax attention" in report.notes["self_attn.attention_output"]


# --- altered models ----------------------------------------------------------------------------------------------


class AlteredConfig(LlamaConfig):
    """Llama under a type attnlens does not register, so that loading infers its family."""

    model_type = "altered_llama"


class CommonAttention(LlamaAttention):
    """Llama's attention written out here, falling back to this module's `eager_attention_forward` (Llama's, unless a
    test replaces it)."""

    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask, scaling=self.scaling, **kwargs
        )
        return self.o_proj(attn_output.reshape(*hidden_states.shape[:-1], -1)), attn_weights


class GatedAttention(CommonAttention):
    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(self, query, key, value, attention_mask, scaling=self.scaling)
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1) * torch.sigmoid(self.gate(hidden_states))
        return self.o_proj(attn_output), attn_weights


class NormedAttention(CommonAttention):
    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(self, query, key, value, attention_mask, scaling=self.scaling)
        return self.o_proj(self.sub_norm(attn_output.reshape(*hidden_states.shape[:-1], -1))), attn_weights


def moved_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Llama's eager function with the scaling moved after the mask: `attn_weights_1` is no longer the masked scores."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3))
    attn_weights = attn_weights * scaling
    attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


def sharpened_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Llama's eager function with one more step after the pattern: every anchor holds, the arithmetic differs."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_weights = attn_weights**2
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


class RenamedLayer(LlamaDecoderLayer):
    """Llama's block with its modules under other names, and a forward that uses them."""

    def forward(self, hidden_states, **kwargs):
        residual = hidden_states
        hidden_states, _ = self.attn(hidden_states=self.attn_norm(hidden_states), **kwargs)
        hidden_states = residual + hidden_states
        return hidden_states + self.ffn(self.ffn_norm(hidden_states))


def altered(attention: type | None = None, layer: type | None = None, **modules) -> torch.nn.Module:
    """A tiny Llama of an unregistered type, its attention's class (with new `modules`) or its blocks' class swapped."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(AlteredConfig(**TINY_DEFAULTS, head_dim=16, attn_implementation="eager")).eval()
    for block in model.model.layers:
        if attention is not None:
            block.self_attn.__class__ = attention
            for name, make in modules.items():
                setattr(block.self_attn, name, make())
        for old, new in (
            {
                "self_attn": "attn",
                "input_layernorm": "attn_norm",
                "mlp": "ffn",
                "post_attention_layernorm": "ffn_norm",
            }.items()
            if layer is not None
            else ()
        ):
            block.add_module(new, block._modules.pop(old))
        if layer is RenamedLayer:
            block.__class__ = layer
    return model


def test_the_common_layout_written_out_is_inferred():
    model = _load(altered(CommonAttention))
    assert model.family.name == "Inferred(altered_llama)"
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[], [], []]


def test_names_are_found_not_assumed():
    with pytest.warns(attnlens.InferredFamilyWarning, match='attention = "attn"') as warned:
        model = _load(altered(layer=RenamedLayer))
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[], [], []]
    assert len(model.support(1).available) == 24  # the 21 values and the three of the KV cache
    assert str(warned[0].message).endswith(model.family.registration())


@pytest.mark.parametrize("model_type", ["glm", "dots1"])  # a dropped activation; dense and sparse-MoE layers
def test_the_printed_registration_serves_what_was_inferred(model_type):
    inferred = _load(_build(model_type))
    exec(inferred.family.registration(), {})
    try:
        registered = _load(_build(model_type))
        assert type(registered.family).__name__ == model_type.capitalize()
        for layer in range(registered.num_layers):
            assert registered.support(layer).reasons == inferred.support(layer).reasons
    finally:
        _REGISTERED.pop(model_type)


REFUSALS = {
    "an output gate before o_proj": (
        dict(attention=GatedAttention, gate=lambda: nn.Linear(64, 64)),
        None,
        "output_path",
        "o_proj(`attn_output.reshape",
    ),
    "a norm before o_proj": (
        dict(attention=NormedAttention, sub_norm=lambda: LlamaRMSNorm(64)),
        None,
        "output_path",
        "o_proj(sub_norm(the attention interface's output))",
    ),
    "the eager function's masked scores moved": (
        dict(attention=CommonAttention),
        moved_eager,
        "anchors",
        "expected operation 'attn_weights_1' on a line containing '+ attention_mask'",
    ),
    "a step added to the eager function": (
        dict(attention=CommonAttention),
        sharpened_eager,
        "eager_function",
        "attn_weights_4: `attn_weights = attn_weights**2`",
    ),
    "modules renamed under the block's forward": (
        dict(layer=LlamaDecoderLayer),
        None,
        "block_forward",
        "self.self_attn(...), which LlamaDecoderLayer does not have",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_an_altered_model_is_refused_naming_the_check(case, monkeypatch):
    arguments, eager, check, found = REFUSALS[case]
    if eager is not None:
        monkeypatch.setitem(globals(), "eager_attention_forward", eager)
    with pytest.warns(attnlens.UnknownFamilyWarning, match=f"check {check}:") as warned:
        model = _load(altered(**arguments))
    assert found in str(warned[0].message)
    assert isinstance(model.family, UnknownLayout)
    assert model.support(0).available == ["layer_input", "layer_output", "embeddings", "logits"]
    assert f"the common layout was refused ({check}: " in model.support(0)["self_attn.attention_probabilities"]
    assert list(CHECKS).index(check) >= 0


def test_a_registered_family_wins_over_inference():
    inner = LlamaForCausalLM(LlamaConfig(**TINY_DEFAULTS, head_dim=16)).eval()
    assert type(_load(inner).family).__name__ == "Llama"


def test_a_config_without_num_hidden_layers_degrades_to_the_block_values(monkeypatch):
    from attnlens import registry

    registry.registered()  # BLT has a family (its local decoder); taken away, the fallback must find blocks itself
    monkeypatch.delitem(registry._BUILT_IN, "blt")
    if "blt" not in CONFIG_MAPPING:
        pytest.skip(f"'blt' is not in transformers {transformers.__version__}")
    inner = survey.build("blt")  # bytes, patches and three lists of blocks; BltConfig has no depth
    with pytest.warns(attnlens.UnknownFamilyWarning, match="check blocks:"):
        model = _load(inner)
    assert model.family.layers == "model.global_transformer.layers"
    assert "no num_hidden_layers" in model.support(0).notes["layer_input"]
    with torch.no_grad(), model.trace(PROMPT):
        block_input = model.layers[0].layer_input.save()
        logits = model.logits.save()
    assert block_input.ndim == 3 and logits.shape[-1] == model.config.vocab_size


def test_the_docs_list_every_check_in_order_and_print_the_registration():
    page = (ROOT / "docs" / "inferred.md").read_text()
    assert re.findall(r"^\| `(\w+)` \|", page, re.M) == list(CHECKS)
    assert page.split("```text\n")[1].split("```")[0] == Inferred(_build("apertus")).registration()


def test_blocks_run_more_than_once_serve_no_block_values():
    """Dory runs a section of its blocks in a loop: a block's input and output are not one tensor per forward, so the
    fallback serves neither (nnsight would give the first run's silently)."""
    model = _load(_build("dory"))
    assert isinstance(model.family, UnknownLayout)
    assert model.support(1).available == ["embeddings", "logits"]
    assert "runs self.layers in 3 loops" in model.support(1)["layer_input"]
    with pytest.raises(attnlens.Unavailable, match="more than once per forward"), torch.no_grad(), model.trace("Hi"):
        model.layers[1].layer_output.save()


@pytest.mark.parametrize(
    ("model_type", "kind"),
    [
        ("reformer", "an encoder (BERT-style) that runs as a decoder only"),
        ("mamba", "attention-free: no module of it is an attention module"),
        ("musicgen", "the decoder of an encoder-decoder model"),
    ],
)
def test_support_says_what_kind_of_model_is_no_plain_decoder(model_type, kind):
    if model_type == "musicgen" and not _builds(model_type):
        pytest.skip(f"the survey builds no musicgen on transformers {transformers.__version__}")
    with pytest.warns(attnlens.UnknownFamilyWarning, match=re.escape(kind)):
        model = _load(_build(model_type))
    assert kind in model.support(0)["self_attn.attention_probabilities"]


def _builds(model_type: str) -> bool:
    try:
        survey.build(model_type)
    except Exception:  # noqa: BLE001  (the config class refuses the survey's sizes on this transformers)
        return False
    return True


@pytest.mark.parametrize(
    ("model_type", "layout"),
    [
        (
            "xlnet",
            "sequence-first here: [seq, batch, hidden], not [batch, seq, hidden] (a forward of 2 prompts of 5 "
            "tokens gives [5, 2, 64] at load)",
        ),
        ("cpmant", "its seq axis holds 32 positions of the model's own besides the prompt's"),
        ("prophetnet", "its seq axis holds 3 streams of the prompt's positions, stacked"),
    ],
)
def test_block_values_laid_out_otherwise_are_noted_as_they_read(model_type, layout):
    """XLNet runs its blocks sequence-first, CPM-Ant adds its prompt's positions, ProphetNet stacks its main and n-gram
    streams: the fallback still serves the blocks' inputs and outputs, and support() says how they are laid out."""
    model = _load(_build(model_type))
    notes = model.support(0).notes
    assert layout in notes["layer_input"] and layout in notes["layer_output"]
    with torch.no_grad(), model.trace(torch.arange(3, 8).repeat(2, 1)):
        block_input = model.layers[0].layer_input.save()
    assert f"[{', '.join(map(str, block_input.shape))}] at load" in notes["layer_input"]


def test_embeddings_that_never_run_as_one_module_are_unavailable():
    """MusicGen's input embeddings are a list of codebook embeddings that its forward sums: the list never runs."""
    if not _builds("musicgen"):
        pytest.skip(f"the survey builds no musicgen on transformers {transformers.__version__}")
    model = _load(_build("musicgen"))
    reason = model.support(0)["embeddings"]
    assert reason.startswith(
        "the input embeddings (model.decoder.embed_tokens) are a ModuleList of 1 modules that never runs as one module"
    )
    with pytest.raises(attnlens.Unavailable, match=re.escape(reason)), torch.no_grad(), model.trace("Hi"):
        model.embeddings.save()


@pytest.mark.parametrize(
    "head", ["NystromformerModel", "NystromformerForMaskedLM", "NystromformerForSequenceClassification"]
)
def test_an_encoder_loads_with_its_block_values_and_says_what_it_is(head):
    """An encoder of a type without a family (it cannot generate) is wrapped for feature extraction, not text
    generation (whose pipeline raised a raw AttributeError): its blocks' inputs and outputs and its embeddings are
    served, equal to transformers' hidden states; its logits where its head gives them (a classifier's are noted as
    laid out otherwise), and a bare encoder says it has none."""
    torch.manual_seed(0)
    config = transformers.NystromformerConfig(**{**_SMALL_BERT, "attn_implementation": "eager"})
    with pytest.warns(attnlens.UnknownFamilyWarning, match="an encoder"):
        model = attnlens.StandardizedEncoder(
            getattr(transformers, head)(config).eval(), tokenizer=attnlens.models.char_tokenizer()
        )
    ids = torch.arange(3, 9)[None]
    with torch.no_grad():
        reference = model._module(input_ids=ids, output_hidden_states=True)
    served = model.support().available
    outputs, logits = [], None
    with torch.no_grad(), model.trace(ids):
        for layer in range(model.num_layers):
            outputs.append(model.layers[layer].layer_output.save())
        if "logits" in served:
            logits = model.logits.save()
    for layer, output in enumerate(outputs):
        assert torch.equal(output, reference.hidden_states[layer + 1])
    if head == "NystromformerModel":
        assert model.support()["logits"].startswith("the model's output (") and "holds no logits" in str(
            model.support()["logits"]
        )
    else:
        assert torch.equal(logits, reference.logits)
    if head == "NystromformerForSequenceClassification":
        assert "not [batch, seq, vocab] here" in model.support().notes["logits"]


_SMALL_BERT = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128)
