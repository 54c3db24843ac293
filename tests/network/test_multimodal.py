"""Vision-language models (llama_type "llava"): a tiny random HF LLaVA, imported with `accessory convert hf`, against
transformers' LlavaForConditionalGeneration on a real photo, at 1, 2 and 3 ranks; images in the engine beside text
rows and in the prefix cache; and every bad input named."""
from __future__ import annotations

import pytest
import torch
from PIL import Image

from accessory.errors import ConfigError
from accessory.model.meta import MetaModel
from distributed import run_ranks
from tiny import build_tiny_llava, greedy_ids

PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"
STEPS = 12


@pytest.fixture(scope="module")
def llava(tiny_llava):
    return MetaModel.from_pretrained(tiny_llava["accessory"], with_visual=True, max_seq_len=512, max_batch_size=4)


@pytest.fixture(scope="module")
def pictures(llava, photo):
    """Two real pictures as the model takes them: the photo padded to a square, and its left half cropped."""
    image = Image.open(photo).convert("RGB")
    half = image.crop((0, 0, image.width // 2, image.height))
    return [llava.image_transform("padded_resize")(image), llava.image_transform("resized_center_crop")(half)]


def hf_greedy(model, ids: list[int], pixels: torch.Tensor, steps: int = STEPS) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels[None], max_new_tokens=steps,
                             do_sample=False, min_new_tokens=steps)
    return out[0, len(ids):].tolist()


def hf_logits(model, ids: list[int], pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), pixel_values=pixels[None]).logits[0]


def test_logits_and_greedy_tokens_equal_transformers(llava, tiny_llava, pictures):
    ids = llava.encode_prompt(PROMPT, image=True)
    for pixels in pictures:
        ours = llava.compute_logits([ids], images=pixels[None])[0]
        torch.testing.assert_close(ours, hf_logits(tiny_llava["model"], ids, pixels), atol=1e-4, rtol=1e-4)
        assert greedy_ids(llava, [ids], STEPS, images=[pixels])[0] == hf_greedy(tiny_llava["model"], ids, pixels)


def test_siglip_tower_equals_transformers(tmp_path, llama_tokenizer, pictures):
    from accessory.checkpoint.convert import convert

    hf = build_tiny_llava(tmp_path / "hf", llama_tokenizer, tower="siglip")
    model = MetaModel.from_pretrained(convert("hf", tmp_path / "hf", tmp_path / "ours"), max_seq_len=512)
    assert model.llma.args.vision["model_type"] == "siglip_vision_model" and model.llma.image_tokens == 64
    ids = model.encode_prompt(PROMPT, image=True)
    torch.testing.assert_close(model.compute_logits([ids], images=pictures[0][None])[0],
                               hf_logits(hf, ids, pictures[0]), atol=1e-4, rtol=1e-4)


def test_rows_with_and_without_images_share_a_batch(llava, pictures):
    text = llava.encode_prompt("Tell me a story about a cheetah.")
    with_image = llava.encode_prompt(PROMPT, image=True)
    rows = [with_image, text, with_image]
    images = [pictures[0], None, pictures[1]]
    together = greedy_ids(llava, rows, STEPS, images=images)
    alone = [greedy_ids(llava, [ids], STEPS, images=[image])[0] for ids, image in zip(rows, images)]
    assert together == alone
    assert together[0] != together[2]  # the two pictures give different answers to the same prompt


def test_generate_and_stream_generate_take_images(llava, pictures):
    texts = llava.generate([PROMPT, "Hello"], images=[pictures[0], None], max_gen_len=STEPS, seed=1)
    stacked = llava.generate([PROMPT, PROMPT], images=torch.stack(pictures), max_gen_len=STEPS)
    *_, last = llava.stream_generate(PROMPT, image=pictures[0][None], max_gen_len=STEPS)
    assert last["text"] == texts[0] == stacked[0] and stacked[0] != stacked[1]
    assert llava.generate(["Hello"], max_gen_len=STEPS) == texts[1:]
    sampled = [llava.generate([PROMPT], images=pictures[:1], max_gen_len=STEPS, temperature=0.8, seed=5)
               for _ in range(2)]
    assert sampled[0] == sampled[1]  # seeds reproduce with images too
    # LLaVA's table has rows past the tokenizer's (here 32064 and 32000): they are never sampled, and a penalty
    # over a prompt holding image tokens (id 32000) reads only the tokenizer's ids
    assert llava.engine.vocab_size == llava.tokenizer.n_words == 32000 < llava.llma.args.vocab_size
    tokens = greedy_ids(llava, [llava.encode_prompt(PROMPT, image=True)], 40, images=pictures[:1], temperature=5.0,
                        repetition_penalty=1.3)[0]
    assert len(tokens) == 40 and max(tokens) < 32000
    stop = texts[0][len(texts[0]) // 2:][:3]
    cut = llava.generate([PROMPT], images=pictures[:1], max_gen_len=STEPS, additional_stop_symbols=[stop])
    assert cut[0] == texts[0][:texts[0].index(stop)]  # stop symbols cut as for text


def test_image_placement(llava):
    n, image_token, bos = llava.llma.image_tokens, llava.llma.image_token, llava.tokenizer.bos_id
    assert n == (112 // 14) ** 2 and llava.llma.image_size == 112
    placed = llava.encode_prompt(PROMPT, image=True)
    start = placed.index(image_token)
    assert placed[start:start + n] == [image_token] * n and placed.count(image_token) == n
    assert placed[:start] == llava.tokenizer.encode("USER: ", bos=True, eos=False)  # LLaVA's own split
    # no placeholder: right after BOS, as LLaMA2-Accessory puts its visual tokens
    plain = llava.encode_prompt("Describe it.", image=True)
    assert plain == [bos] + [image_token] * n + llava.tokenizer.encode("Describe it.", bos=False, eos=False)
    # in a chat, a message's "<image>" places the image, and the rest of the message stays plain text
    from accessory.generation.chat import render_chat

    prompt, _ = render_chat(llava.tokenizer, [{"role": "user", "content": "<image>\nIs </s> in it?"}])
    chat = llava.encode_prompt(prompt, image=True)
    assert chat.count(image_token) == n and llava.tokenizer.eos_id not in chat


def test_prefix_cache_reuses_only_the_same_image(llava, pictures):
    from accessory.generation.sampling import SamplingParams
    from accessory.generation.requests import Request

    first = llava.encode_prompt("A chat between a curious human and an artificial intelligence assistant. " + PROMPT,
                                image=True)
    follow_up = first + llava.tokenizer.encode(" A cat. USER: and the colour? ASSISTANT:", bos=False, eos=False)
    runs = [(first, pictures[0]), (follow_up, pictures[0]), (follow_up, pictures[1])]

    def outputs(engine):  # one row: each request runs after the last, its finished sequence kept for reuse
        requests = [Request(i, ids, SamplingParams(max_gen_len=4), 0, image=image) for i, (ids, image) in
                    enumerate(runs)]
        engine.stop_ids = set()
        for _ in engine.stream(requests):
            pass
        return [request.generated for request in requests]

    cached = llava.engine.configured(max_batch_size=1)
    with_cache = outputs(cached)
    start = first.index(llava.llma.image_token)
    # the second reuses the whole first prompt; the third only the text before its other image
    assert start >= 16 and cached.stats.reused_tokens == len(first) + start
    assert with_cache == outputs(llava.engine.configured(max_batch_size=1, prefix_cache=False))
    assert with_cache[1] != with_cache[2]


def _tensor_parallel(folder, images, prompts):
    model = MetaModel.from_pretrained(folder, max_seq_len=512, max_batch_size=4)
    ids = [model.encode_prompt(p, image=image is not None) for p, image in zip(prompts, images)]
    logits = model.compute_logits(ids[:1], images=images[:1])[0]
    return greedy_ids(model, ids, STEPS, images=images), logits


def test_tensor_parallel_equals_one_process(llava, tiny_llava, pictures, tmp_path):
    from accessory.checkpoint.reshard import reshard

    two_shards = reshard(tiny_llava["accessory"], tmp_path / "two", 2)
    images, prompts = [pictures[0], None, pictures[1]], [PROMPT, "Hello there", "Describe it."]
    expected = _tensor_parallel(tiny_llava["accessory"], images, prompts)
    first = llava.encode_prompt(PROMPT, image=True)
    assert expected[0][0] == hf_greedy(tiny_llava["model"], first, pictures[0])
    for world, folder in ((2, tiny_llava["accessory"]), (3, two_shards)):  # 1 -> 2 and 2 -> 3 ranks
        for tokens, logits in run_ranks(world, _tensor_parallel, folder, images, prompts):
            assert tokens == expected[0]
            torch.testing.assert_close(logits, expected[1], atol=1e-4, rtol=1e-4)


def test_bad_image_inputs_are_named(llava, pictures, tiny_checkpoints):
    with pytest.raises(ValueError, match=r"images\[0\] must be a float tensor of shape \(3, 112, 112\)"):
        llava.generate([PROMPT], images=[torch.zeros(3, 64, 64)])
    with pytest.raises(ValueError, match="2 images for 1 prompts"):
        llava.generate([PROMPT], images=torch.stack(pictures))
    with pytest.raises(ValueError, match="holds the image placeholder '<image>' but no image"):
        llava.generate(["<image> hi"], images=None)
    with pytest.raises(ValueError, match="example 0 holds 1 image tokens .* with no image it must hold 0"):
        llava.compute_logits([[1, llava.llma.image_token]])
    with pytest.raises(ValueError, match="2 '<image>' placeholders"):
        llava.generate(["<image> and <image>"], images=pictures[:1])
    with pytest.raises(ValueError, match="never truncated"):
        llava.generate([PROMPT], images=pictures[:1], max_gen_len=450)
    text_model = MetaModel.from_pretrained(tiny_checkpoints["mha", 1], max_seq_len=256)
    with pytest.raises(ValueError, match="reads text only"):
        text_model.generate(["Hi"], images=pictures[:1])
    with pytest.raises(ConfigError, match="holds a text model"):
        MetaModel.from_pretrained(tiny_checkpoints["mha", 1], with_visual=True)


@pytest.mark.parametrize("llama_type", ["llama_qformerv2", "llama_ens", "llama_adapter"])
def test_llama2_accessory_multimodal_types_are_refused_by_name(tiny_checkpoints, llama_type):
    with pytest.raises(ConfigError, match=f"{llama_type}.*LLaMA2-Accessory's multimodal types.*'llava'"):
        MetaModel.from_pretrained(tiny_checkpoints["mha", 1], llama_type=llama_type)


def test_import_reads_every_hf_layout(tiny_llava, tmp_path):
    """The Hub's llava-1.5-hf names (`vision_tower.vision_model.*`) and transformers 5's in-memory ones
    (`model.language_model.*`, `lm_head.weight`) import to the same tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    from accessory.checkpoint.importers import read_hf

    saved = load_file(tiny_llava["hf"] / "model.safetensors")
    layouts = {
        "hub": {k.replace("vision_tower.", "vision_tower.vision_model."): v for k, v in saved.items()},
        "v5": {("lm_head.weight" if k == "language_model.lm_head.weight" else
                "model." + k.replace("language_model.model.", "language_model.")): v for k, v in saved.items()},
    }
    reference = read_hf(tiny_llava["hf"]).state_dict
    for name, weights in layouts.items():
        folder = shutil.copytree(tiny_llava["hf"], tmp_path / name)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        imported = read_hf(folder).state_dict
        assert imported.keys() == reference.keys() and all(torch.equal(imported[k], reference[k]) for k in reference)
