"""Images from the command line: `accessory generate --image` (at 2 ranks, and with --chat), and `accessory batch`
records with an "image", each equal to `MetaModel.generate` / `chat` in this process on the same tiny random LLaVA
and real photo; a bad image file, or an image for a text model, is named before anything is generated."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from distributed import free_port

PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"
QUESTION = "What is in the picture?"
STEPS = 8
SAMPLING = dict(max_gen_len=STEPS, temperature=0.0, top_p=0.95, top_k=0, repetition_penalty=1.0, seed=None)


@pytest.fixture(scope="module")
def llava(tiny_llava):
    from accessory.model.meta import MetaModel

    return MetaModel.from_pretrained(tiny_llava["accessory"], with_visual=True, max_seq_len=512)


def pixels_of(llava, path, transform: str = "padded_resize"):
    return llava.image_transform(transform)(Image.open(path).convert("RGB"))


def test_generate_with_an_image_at_two_ranks_prints_what_generate_gives(llava, tiny_llava, photo):
    """Rank 0 reads the file and sends the pixels; --image-transform reaches them."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "accessory", "generate", "--pretrained_path",
               str(tiny_llava["accessory"]), "--max_seq_len", "512", "--max_gen_len", str(STEPS), "--image",
               str(photo), "--image-transform", "resized_center_crop", "--prompt", PROMPT]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    [expected] = llava.generate([PROMPT], images=[pixels_of(llava, photo, "resized_center_crop")],
                                max_gen_len=STEPS)
    assert result.stdout == expected + "\n"


def cli(*args: str) -> None:
    from accessory.cli import main

    main(list(args))


def test_generate_chat_puts_the_image_in_the_users_message(llava, tiny_llava, photo, capsys):
    cli("generate", "--pretrained_path", str(tiny_llava["accessory"]), "--max_seq_len", "512", "--max_gen_len",
        str(STEPS), "--image", str(photo), "--chat", "--prompt", QUESTION)
    expected = llava.chat([{"role": "user", "content": f"<image>\n{QUESTION}"}], image=pixels_of(llava, photo),
                          max_gen_len=STEPS)
    assert capsys.readouterr().out == expected + "\n"


def test_bad_image_arguments_exit_2_naming_the_file(tiny_llava, tiny_checkpoints, photo, tmp_path, caplog):
    missing = tmp_path / "missing.png"
    with pytest.raises(SystemExit) as exited:
        cli("generate", "--pretrained_path", str(tiny_llava["accessory"]), "--image", str(missing), "--prompt", "Hi")
    assert exited.value.code == 2 and f"--image {missing}: no such image file" in caplog.text
    assert "loading weights" not in caplog.text and "loaded" not in caplog.text  # refused before any model loads
    with pytest.raises(SystemExit) as exited:
        cli("generate", "--pretrained_path", str(tiny_checkpoints["mha", 1]), "--image", str(photo), "--prompt", "Hi")
    assert exited.value.code == 2 and f"--image {photo}: this model (llama) reads text only" in caplog.text


# ---- accessory batch ------------------------------------------------------------------------------------------------

def records_beside(tmp_path, photo, *extra: dict) -> list[dict]:
    """An image record (a path relative to the input's folder), a text record, a conversation with an image (an
    absolute path), and `extra`."""
    (tmp_path / "pics").mkdir(exist_ok=True)
    shutil.copy(photo, tmp_path / "pics" / "cheetah.jpg")
    return [{"id": "photo", "prompt": PROMPT, "image": "pics/cheetah.jpg"},
            {"id": "text", "prompt": "Once upon a time"},
            {"id": "chat", "messages": [{"role": "user", "content": QUESTION}], "image": str(photo)}, *extra]


def batch(tmp_path, records: list[dict], load_model):
    from accessory.batch import BatchOptions, run_batch

    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    options = BatchOptions(source, tmp_path / "out.jsonl", max_seq_len=512)
    run_batch(options, SAMPLING, load_model)
    return {row["id"]: row for row in map(json.loads, options.output.read_text().splitlines())}


def no_model(group):
    raise AssertionError("a model was loaded where none should be")


def test_batch_records_with_images_equal_generate_in_process(llava, photo, tmp_path):
    rows = batch(tmp_path, records_beside(tmp_path, photo), lambda group: llava)
    pixels = pixels_of(llava, photo)
    assert rows["photo"]["output"] == llava.generate([PROMPT], images=[pixels], max_gen_len=STEPS)[0]
    assert rows["photo"]["prompt_tokens"] == len(llava.encode_prompt(PROMPT, image=True))
    assert rows["text"]["output"] == llava.generate(["Once upon a time"], max_gen_len=STEPS)[0]
    assert rows["chat"]["output"] == llava.chat([{"role": "user", "content": f"<image>\n{QUESTION}"}], image=pixels,
                                                max_gen_len=STEPS)


@pytest.mark.parametrize("image, message", [
    ("pics/missing.png", '"image" of record \'bad\': {tmp}/pics/missing.png: no such image file'),
    ("pics/corrupt.png", '"image" of record \'bad\': {tmp}/pics/corrupt.png: not a readable image'),
    (7, '"image" of record \'bad\' must be the path of an image file, got a JSON number'),
], ids=["missing", "corrupt", "not-a-string"])
def test_bad_image_record_is_named_before_loading(photo, tmp_path, image, message):
    from accessory.batch.errors import BatchInputError

    records = records_beside(tmp_path, photo, {"id": "bad", "prompt": "Hi", "image": image})
    (tmp_path / "pics" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really" * 50)
    with pytest.raises(BatchInputError) as error:
        batch(tmp_path, records, no_model)
    assert str(error.value).startswith(f"{tmp_path / 'in.jsonl'}:4: ")
    assert message.format(tmp=tmp_path) in str(error.value)
    assert not list(tmp_path.glob("out.jsonl*"))


def test_batch_image_record_for_a_text_model_is_named(tiny_checkpoints, photo, tmp_path):
    from accessory.batch.errors import BatchInputError
    from accessory.model.meta import MetaModel

    text_model = MetaModel.from_pretrained(tiny_checkpoints["mha", 1], max_seq_len=512)
    with pytest.raises(BatchInputError, match="input line 1: record 'photo': an image was given, but this model "
                                              r"\(llama\) reads text only"):
        batch(tmp_path, records_beside(tmp_path, photo), lambda group: text_model)
