"""Images in `accessory serve`'s chat API: a tiny random LLaVA served at one rank answers an image_url part as
`MetaModel.generate` does in this process on the same rendered prompt and pixels (whole, streamed, beside a text
request, from a local file when --allow-local-images is on), counts the image's tokens, and names each bad image
by its field; a text model refuses image parts. Anthropic's image block is read the same way."""
from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PIL import Image

from serving import KEY, Server, streamed_text

LLAVA = "tiny-llava"
QUESTION = "What is in the picture?"
MAX_TOKENS = 8
MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS = 200_000, 300_000  # the server's limits: the photo (256 x 256) is within both


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def asked(*parts: dict) -> list[dict]:
    """A user message of `parts`: the image first, then the question, as LLaVA-1.5 is prompted."""
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def llava_server(tiny_llava, tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("llava-serve"), "--pretrained_path", str(tiny_llava["accessory"]),
                    "--model-name", LLAVA, "--allow-local-images", "--max-image-bytes", str(MAX_IMAGE_BYTES),
                    "--max-image-pixels", str(MAX_IMAGE_PIXELS), nproc=1)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def llava(tiny_llava):
    from accessory.model.meta import MetaModel

    return MetaModel.from_pretrained(tiny_llava["accessory"], with_visual=True, max_seq_len=512)  # as served


@pytest.fixture(scope="module")
def photo_png(photo) -> bytes:
    return png(Image.open(photo).convert("RGB"))


def in_process(llava, content: str, image_png: bytes = None) -> tuple[str, int]:
    """(the greedy reply, the prompt's token count) to one user message, in this process."""
    from accessory.generation.chat import render_chat

    prompt, stops = render_chat(llava.tokenizer, [{"role": "user", "content": content}])
    pixels = None if image_png is None else [llava.image_transform()(Image.open(io.BytesIO(image_png)))]
    [text] = llava.generate([prompt], images=pixels, max_gen_len=MAX_TOKENS, additional_stop_symbols=stops)
    return text, len(llava.encode_prompt(prompt, image=pixels is not None))


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def ask(client, messages: list[dict], **options):
    return client.chat.completions.create(model=LLAVA, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          **options)


def test_image_chat_equals_generate_in_process(llava_server, llava, photo_png, tmp_path):
    """Whole and streamed, from a data: URL and from a file:// one (the server was started with
    --allow-local-images), the same reply as generate on the prompt rendered with "<image>" where the part was."""
    expected, prompt_tokens = in_process(llava, f"<image>\n{QUESTION}", photo_png)
    client = llava_server.client()
    whole = ask(client, asked(image_part(data_url(photo_png))))
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == prompt_tokens  # the image's 64 tokens included
    streamed, _, _ = streamed_text(ask(client, asked(image_part(data_url(photo_png))), stream=True))
    assert streamed == expected
    (tmp_path / "photo.png").write_bytes(photo_png)
    assert ask(client, asked(image_part((tmp_path / "photo.png").as_uri()))).choices[0].message.content == expected
    counted = post(llava_server, "/tokenize", {"messages": asked(image_part(data_url(photo_png)))}).json()
    assert counted["count"] == prompt_tokens and counted["tokens"].count(llava.llma.image_token) == 64


def test_an_anthropic_image_block_is_read_as_an_image_url_part(llava_server, llava, photo_png):
    """/v1/messages through the anthropic client (x-api-key): a base64 image block before the question gives the
    reply generate gives in this process."""
    import anthropic

    client = anthropic.Anthropic(base_url=llava_server.url, api_key=KEY, max_retries=0)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(photo_png).decode()}}
    answer = client.messages.create(model=LLAVA, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}])
    expected, prompt_tokens = in_process(llava, f"<image>\n{QUESTION}", photo_png)
    assert answer.content[0].text == expected and answer.usage.input_tokens == prompt_tokens


def test_image_and_text_requests_answer_together(llava_server, llava, photo_png):
    text_only = [{"role": "user", "content": QUESTION}]
    client = llava_server.client()
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda m: ask(client, m).choices[0].message.content,
                                [asked(image_part(data_url(photo_png))), text_only]))
    assert answers == [in_process(llava, f"<image>\n{QUESTION}", photo_png)[0], in_process(llava, QUESTION)[0]]


@pytest.fixture(scope="module")
def bad_requests(photo) -> dict:
    """name -> (messages, the field named, what the message says)."""
    big = png(Image.open(photo).convert("RGB").resize((1024, 1024)))  # more bytes than --max-image-bytes
    wide = png(Image.new("RGB", (600, 600), "white"))  # few bytes, but more pixels than --max-image-pixels
    first = "messages.0.content.0"
    url = f"{first}.image_url.url"
    return {
        "remote": (asked(image_part("https://example.com/cat.png")), url, "remote image URLs are refused"),
        "metadata": (asked(image_part("http://169.254.169.254/latest/meta-data/")), url,
                     "remote image URLs are refused"),
        "oversize": (asked(image_part(data_url(big))), url, f"the limit is {MAX_IMAGE_BYTES} bytes"),
        "pixels": (asked(image_part(data_url(wide))), url, f"600x600 = 360000 pixels; the limit is "
                                                           f"{MAX_IMAGE_PIXELS}"),
        "corrupt": (asked(image_part(data_url(png(Image.open(photo))[:2000]))), url, "not a readable image"),
        "two": (asked(image_part(data_url(wide)), image_part(data_url(wide))), "messages.0.content.1",
                "a second image (messages.0.content.0 is the first)"),
        "audio": (asked({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}), first,
                  "'input_audio' parts are not supported"),
        "placeholder": ([{"role": "user", "content": f"<image>\n{QUESTION}"}], "messages.0.content",
                        "holds the image placeholder '<image>' as text"),
        "no-url": (asked({"type": "image_url", "image_url": {"href": "x"}}), url, "Field required"),
    }


@pytest.mark.parametrize("case", ["remote", "metadata", "oversize", "pixels", "corrupt", "two", "audio",
                                  "placeholder", "no-url"])
def test_bad_images_are_named(llava_server, bad_requests, case):
    messages, field, message = bad_requests[case]
    answer = post(llava_server, "/v1/chat/completions", {"model": LLAVA, "messages": messages})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: ") and message in error["message"]


def test_the_body_limit_has_room_for_one_image(llava_server):
    """By default 8MB for text, plus one image at --max-image-bytes (here 200,000) as base64: 266,668 characters
    (a text model's limit is 8MB alone: test_serve_refusals.py)."""
    from test_serve_refusals import declared

    status, body = declared(llava_server, 8_266_669)
    assert status == 413 and "over 8266668 bytes" in body["error"]["message"], body
    assert "one --max-image-bytes image" in body["error"]["message"]
    answer = post(llava_server, "/v1/chat/completions", {"model": LLAVA, "messages": [
        {"role": "user", "content": "x" * 8_100_000}]})  # past 8MB, within the limit: refused for its length
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded", answer.text


def test_local_images_are_refused_without_the_flag(llava, photo):
    """The server above allows local files; the default (ImageOptions()) refuses them, naming the flag."""
    from accessory.serve.api_errors import APIError
    from accessory.serve.images import ImageOptions, ImageRef, image_pixels

    with pytest.raises(APIError) as refused:
        image_pixels(llava, ImageRef(str(photo), "messages.0.content.0"), ImageOptions())
    assert refused.value.status == 400 and refused.value.param == "messages.0.content.0.image_url.url"
    assert "local image files are off" in refused.value.message and "--allow-local-images" in refused.value.message
    assert image_pixels(llava, ImageRef(photo.as_uri(), "x"), ImageOptions(allow_local_files=True)).shape == \
        (3, 112, 112)


def test_text_model_refuses_image_parts(server, photo_png):
    from serving import MODEL

    answer = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}, image_part(data_url(photo_png))]}]})
    assert answer.status_code == 400
    assert answer.json()["error"] == {
        "message": "messages.0.content.1: 'image_url' parts are not supported: this model reads text only",
        "type": "invalid_request_error", "param": "messages.0.content.1", "code": None}
