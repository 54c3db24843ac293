"""The gradio chat demos (demos/): the page in a real browser (headless Debian chromium through selenium) against
the default model, multi-turn at 3 ranks under torchrun and single-turn alone, and multi-turn about an image against
a tiny LLaVA, each stopped by SIGTERM; and, without a browser, what each demo sends to the generation service, and
the command demos/start.sh builds.

ACCESSORY_DEMO_SCREENSHOT=docs/demo-multi-turn.png refreshes the screenshot in docs/demos.md from the 3-rank run.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO
from distributed import free_port

sys.path.insert(0, str(REPO / "demos"))  # the demos are scripts, not a package: import them as their runs do

import chat_ui  # noqa: E402
import multi_turn  # noqa: E402
import single_turn  # noqa: E402
import single_turn_mm  # noqa: E402

from accessory.generation.requests import Event  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
QUESTION = "What is the capital of France?"
needs_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                    reason=f"{CHROMIUM} is missing (Debian's chromium and chromium-driver; "
                                           f".ci/run installs them when it runs as root)")


# ---- in a browser -------------------------------------------------------------------------------------------------

@needs_chromium
def test_multi_turn_at_three_ranks_answers_in_the_browser_and_stops_on_sigterm(smollm2_checkpoint, browser, tmp_path):
    """Rank 0 serves the page, ranks 1 and 2 follow; the model's end-of-turn token <|im_end|> never shows; SIGTERM to
    the rank-0 worker ends all three cleanly (torchrun's status is 0 only if every rank's is)."""
    port, log = free_port(), tmp_path / "demo.log"
    demo = start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint=127.0.0.1:{free_port()}", "demos/multi_turn.py", "--port", str(port),
                  "--max_gen_len", "48"], log)
    try:
        page = ChatPage(browser, port, demo, log)
        seen = page.ask(QUESTION)
        assert "Paris" in page.answer(), page.answer()
        assert not [text for text in seen if "<|" in text or "im_end" in text], seen
        if os.environ.get("ACCESSORY_DEMO_SCREENSHOT"):
            browser.execute_script("window.scrollTo(0, 0)")  # clicking Submit scrolled the page down
            browser.save_screenshot(os.environ["ACCESSORY_DEMO_SCREENSHOT"])
        workers = worker_pids(demo.pid)
        assert sorted(workers) == [0, 1, 2], f"torchrun's workers by rank: {workers}"
        os.kill(workers[0], signal.SIGTERM)
        assert wait(demo) == 0, log.read_text()[-3000:]
        assert not [pid for pid in workers.values() if alive(pid)], "a rank outlived torchrun"
    finally:
        kill(demo)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@needs_chromium
def test_single_turn_alone_holds_back_the_template_separator_and_undoes(smollm2_checkpoint, browser, tmp_path):
    """One process, LLaMA2-Accessory's "default" template, whose turns end with "\\n###": no part of it is ever on
    the page (as text, or as the empty markdown heading a lone "#" line renders to); Enter sends; Undo removes the
    exchange."""
    port, log = free_port(), tmp_path / "demo.log"
    demo = start([sys.executable, "demos/single_turn.py", "--port", str(port), "--template", "default",
                  "--max_gen_len", "48"], log)
    try:
        page = ChatPage(browser, port, demo, log)
        seen = page.ask(QUESTION, by_enter=True)
        assert "Paris" in page.answer(), page.answer()
        assert not [text for text in seen if "#" in text or HEADING in text], seen
        page.click("undo")
        page.wait_for(lambda: QUESTION not in page.chat_text(), "the exchange to be undone")
        demo.send_signal(signal.SIGTERM)
        assert wait(demo) == 0, log.read_text()[-3000:]
    finally:
        kill(demo)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@needs_chromium
def test_multi_turn_mm_answers_about_an_uploaded_photo_as_the_model_does(tiny_llava, photo, browser, tmp_path):
    """One process, a tiny random LLaVA: a picture uploaded in the page gives, turn after turn, the greedy answers
    the model gives in-process to the same messages (the image's placeholder in the first user message only) and
    pixels; a new upload starts a new conversation. The picture is the photo's top half: not square, so that
    padding and cropping it to a square give different answers."""
    from PIL import Image

    from accessory.model.meta import MetaModel

    port, log, picture = free_port(), tmp_path / "demo.log", tmp_path / "top-half.png"
    demo = start([sys.executable, "demos/multi_turn_mm.py", "--pretrained_path", str(tiny_llava["accessory"]),
                  "--port", str(port), "--max_gen_len", "12"], log)
    image = Image.open(photo).convert("RGB")
    image.crop((0, 0, image.width, image.height // 2)).save(picture)
    model = MetaModel.from_pretrained(tiny_llava["accessory"], with_visual=True, max_seq_len=512)
    pixels = model.image_transform("padded_resize")(Image.open(picture))
    try:
        page = ChatPage(browser, port, demo, log)
        page.upload(picture)
        messages = []
        for question in ("<image>\nWhat is in the picture?", "What colour is it?"):
            page.ask(question.removeprefix("<image>\n"))
            messages.append({"role": "user", "content": question})
            expected = model.chat(messages, max_gen_len=12, image=pixels)
            assert page.answer().split() == expected.split(), messages  # markdown folds runs of spaces
            messages.append({"role": "assistant", "content": expected})
        page.upload(photo)
        page.wait_for(lambda: "What is" not in page.chat_text(), "the conversation to be cleared")
        demo.send_signal(signal.SIGTERM)
        assert wait(demo) == 0, log.read_text()[-3000:]
    finally:
        kill(demo)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


# ---- the browser and the launch -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One headless chromium for the module's demos (each serves its page on a port of its own)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,960", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


# Records what the chat shows after every change to it, marking a markdown heading (which hides its "#"s).
HEADING = "[a heading]"
RECORD_CHAT = """
const chat = document.querySelector('#chatbot');
window.chatSeen = [];
new MutationObserver(() => window.chatSeen.push(
    chat.innerText + (chat.querySelector('.message :is(h1, h2, h3, h4, h5, h6)') ? ' HEADING' : '')
)).observe(chat, {subtree: true, childList: true, characterData: true});
""".replace("HEADING", HEADING)


BOT = "#chatbot [data-testid='bot']"  # the model's messages


class ChatPage:
    def __init__(self, driver, port: int, demo: subprocess.Popen, log: Path):
        self.driver, self.demo, self.log = driver, demo, log
        url = f"http://127.0.0.1:{port}/"
        wait_for_page(url, demo, log)
        driver.get(url)
        self.wait_for(lambda: self.find("#message textarea"), "the message box")

    def ask(self, question: str, by_enter: bool = False) -> list[str]:
        """Type the question, send it (Submit, or Enter), wait for the whole answer; returns every text the chat
        showed meanwhile."""
        from selenium.webdriver.common.keys import Keys

        self.driver.execute_script(RECORD_CHAT)
        answers = len(self.find_all(BOT))  # until this answer starts, the status tells the last one's end
        self.find("#message textarea").send_keys(question + (Keys.ENTER if by_enter else ""))
        if not by_enter:
            self.click("submit")
        self.wait_for(lambda: len(self.find_all(BOT)) > answers and self.text("#status").startswith(("Done", "Cut")),
                      "the answer to end")
        return self.driver.execute_script("return window.chatSeen")

    def upload(self, image: Path) -> None:
        """Choose `image` in the image box, and wait until the page has started a new conversation for it."""
        self.wait_for(lambda: self.find("#image input[type=file]"), "the image box")
        self.find("#image input[type=file]").send_keys(str(image))
        self.wait_for(lambda: self.text("#status") == "A new conversation about this image.", "the upload")

    def answer(self) -> str:
        return self.text(BOT)

    def chat_text(self) -> str:
        return self.text("#chatbot")

    def click(self, elem_id: str) -> None:
        self.find(f"#{elem_id}").click()

    def text(self, css: str) -> str:
        element = self.find(css)
        return element.text if element is not None else ""

    def find(self, css: str):
        found = self.find_all(css)
        return found[-1] if found else None

    def find_all(self, css: str) -> list:
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def wait_for(self, ok, what: str, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while not ok():
            assert self.demo.poll() is None, f"the demo ended while waiting for {what}:\n{self.log.read_text()[-3000:]}"
            assert time.time() < deadline, f"waited {timeout}s for {what}; chat shows {self.chat_text()!r}"
            time.sleep(0.1)


def start(command: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_page(url: str, demo: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while True:
        assert demo.poll() is None, f"the demo ended (status {demo.returncode}) before serving:\n" \
                                    f"{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert time.time() < deadline, f"no page at {url} after {timeout}s:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def worker_pids(parent: int) -> dict[int, int]:
    """{RANK: pid} of the children of `parent` (torchrun) that have RANK in their environment."""
    pids = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state, then ppid
            environ = (stat.parent / "environ").read_bytes().split(b"\0") if ppid == parent else []
        except (OSError, ValueError, IndexError):  # it ended meanwhile
            continue
        ranks = [int(item[5:]) for item in environ if item.startswith(b"RANK=")]
        if ranks:
            pids[ranks[0]] = int(stat.parent.name)
    return pids


def wait(proc: subprocess.Popen, timeout: float = 60) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {timeout}s after SIGTERM: {proc.args}")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; only its exit status waits to be collected


def kill(proc: subprocess.Popen) -> None:
    """After a failure: end the launch and every rank it started. torchrun starts each worker in a session of its
    own, so killing torchrun's session alone would leave the ranks running."""
    if proc.poll() is None:
        workers = worker_pids(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


# ---- what the page sends to the service, without a browser --------------------------------------------------------

class FakeService:
    """Records submitted requests; answers each with the scripted events."""

    def __init__(self, texts: list[str], finish: str = "stop"):
        self.texts, self.finish, self.requests, self.cancelled = texts, finish, [], 0

    def submit_chat(self, messages, sampling, template=None, image=None):
        self.requests.append((messages, sampling, template, image))
        return FakeHandle(self)


class FakeHandle:
    def __init__(self, service: FakeService):
        self.service = service

    def __iter__(self):
        texts = self.service.texts
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            yield Event("fake", text, text[len(texts[i - 1]) if i else 0:], last,
                        self.service.finish if last else None, i + 1)

    def cancel(self):
        self.service.cancelled += 1


SETTINGS = dict(template=chat_ui.MODEL_TEMPLATE, system="", max_gen_len=48, temperature=0.0, top_p=0.95, top_k=0,
                repetition_penalty=1.0, seed="")
EARLIER = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


def reply(service, context, text="Why?", history=EARLIER, image=None, **settings) -> list[tuple]:
    return list(chat_ui.stream_reply(service, context, text, history, image, *{**SETTINGS, **settings}.values()))


def test_multi_turn_sends_the_whole_conversation_and_single_turn_the_question_alone():
    multi, single = FakeService(["Be", "Because."]), FakeService(["Be", "Because."])
    reply(multi, multi_turn.whole_conversation)
    reply(single, single_turn.last_question)
    asked = {"role": "user", "content": "Why?"}
    assert multi.requests[0][0] == [*EARLIER, asked]
    assert single.requests[0][0] == [asked]


def test_a_reply_streams_into_the_history_with_the_page_settings():
    service = FakeService(["Be", "Because."], finish="length")
    steps = reply(service, multi_turn.whole_conversation, system="Be brief.", template="vicuna_v1_1", seed="7",
                  top_k=40, temperature=0.5)
    messages, sampling, template, image = service.requests[0]
    assert messages[0] == {"role": "system", "content": "Be brief."} and template == "vicuna_v1_1" and image is None
    assert sampling == dict(max_gen_len=48, temperature=0.5, top_p=0.95, top_k=40, repetition_penalty=1.0, seed=7)
    box, history, chatbot, status = steps[-1]
    assert box == "" and history[-1] == {"role": "assistant", "content": "Because."}
    assert status == "Cut at max_gen_len (2 tokens)." and len(steps) == 3  # the question, then each event
    assert chatbot[-1]["content"] == [{"type": "text", "text": "Because."}]
    service.finish = "stop"
    assert reply(service, multi_turn.whole_conversation)[-1][3] == "Done (2 tokens)."
    assert service.requests[-1][1]["seed"] is None and service.requests[-1][2] is None  # empty seed; model's own


def test_closing_a_reply_early_cancels_its_request_and_a_finished_one_does_not():
    service = FakeService(["Be", "Because."])
    steps = chat_ui.stream_reply(service, multi_turn.whole_conversation, "Why?", [], None, *SETTINGS.values())
    next(steps), next(steps)  # the question shown, then the first event; then Stop closes the generator
    steps.close()
    assert service.cancelled == 1
    reply(service, multi_turn.whole_conversation)
    assert service.cancelled == 1


def test_an_empty_message_or_a_bad_seed_sends_nothing():
    import gradio as gr

    service = FakeService(["x"])
    assert reply(service, multi_turn.whole_conversation, text="  ") == [("  ", EARLIER, chat_ui.display(EARLIER), "")]
    with pytest.raises(gr.Error, match="seed must be an integer"):
        reply(service, multi_turn.whole_conversation, seed="one")
    assert service.requests == []


def test_with_an_image_its_placeholder_leads_the_first_user_message_the_model_sees():
    """Multi-turn: once, before the conversation (after the system message); single-turn: before the question."""
    multi, single, pixels = FakeService(["It is"]), FakeService(["It is"]), object()
    reply(multi, multi_turn.whole_conversation, image=pixels, system="Be brief.")
    reply(single, single_turn_mm.last_question, image=pixels)
    messages, *_, image = multi.requests[0]
    assert image is pixels and messages == [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "<image>\nHi"}, EARLIER[1],
                                            {"role": "user", "content": "Why?"}]
    assert single.requests[0][0] == [{"role": "user", "content": "<image>\nWhy?"}] and single.requests[0][3] is pixels


def test_an_upload_becomes_pixels_through_the_image_limits(photo, tmp_path):
    import gradio as gr
    from PIL import Image

    from accessory.data.transform import get_transform

    transform = get_transform("padded_resize", 112)
    assert chat_ui.read_image(str(photo), transform).equal(transform(Image.open(photo).convert("RGB")))
    assert chat_ui.read_image(None, transform) is None
    (tmp_path / "notes.png").write_text("not a picture")
    with pytest.raises(gr.Error, match=f"the image cannot be used: {tmp_path}/notes.png: not a readable image"):
        chat_ui.read_image(str(tmp_path / "notes.png"), transform)


def test_image_demos_refuse_a_text_model_before_serving(tiny_checkpoints, capsys):
    """Without --pretrained_path, before anything loads; with a text checkpoint, once it has loaded."""
    with pytest.raises(SystemExit) as exit:
        chat_ui.parse_args("demo", [], image=True)
    assert exit.value.code == 2 and "--pretrained_path (the built-in SmolLM2" in capsys.readouterr().err
    folder = tiny_checkpoints["mha", 1]
    result = subprocess.run([sys.executable, "demos/single_turn_mm.py", "--pretrained_path", str(folder), "--port",
                             str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{chat_ui.NEEDS_IMAGES}; {folder} holds a text model (llama_type 'llama')" in result.stderr
    assert "demo page" not in result.stderr and "Traceback" not in result.stderr


def test_undo_removes_the_last_exchange_even_if_its_answer_was_cut_off():
    history = [*EARLIER, {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Beca"}]
    assert chat_ui.undo_last(history)[0] == EARLIER
    assert chat_ui.undo_last([*EARLIER, {"role": "user", "content": "Why?"}])[0] == EARLIER
    assert chat_ui.undo_last(EARLIER)[0] == []


# ---- demos/start.sh -----------------------------------------------------------------------------------------------

def start_sh(answers: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "demos" / "start.sh"), "--print", *args], input=answers, capture_output=True,
                          text=True, timeout=30, env=dict(os.environ, PYTHON="python"))


def test_start_sh_builds_the_torchrun_command_from_the_answers(tmp_path):
    demos = REPO / "demos"
    assert start_sh("\n3\nsingle\n7870\n").stdout.split() == [
        "python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", f"{demos}/single_turn.py",
        "--port", "7870"]
    assert start_sh(f"{tmp_path}\n\n\n\n", "--", "--temperature", "0.7").stdout.split()[4:] == [
        "--nproc-per-node=1", f"{demos}/multi_turn.py", "--port", "7860", "--pretrained_path", str(tmp_path),
        "--temperature", "0.7"]
    assert start_sh(f"{tmp_path}\n2\nsingle_mm\n\n").stdout.split()[4:6] == [
        "--nproc-per-node=2", f"{demos}/single_turn_mm.py"]


@pytest.mark.parametrize("answers, message", [
    ("/no/such/folder\n", "no such checkpoint folder: /no/such/folder"),
    ("\nthree\n", "ranks must be a positive integer, got 'three'"),
    ("\n1\nboth\n", "answer single, multi, single_mm or multi_mm, got 'both'"),
    ("\n1\nmulti_mm\n", "the image demos need a vision-language checkpoint folder (llama_type 'llava')"),
    ("\n1\nmulti\n99999\n", "port must be 1-65535, got '99999'"),
])
def test_start_sh_refuses_a_bad_answer_by_name(answers, message):
    result = start_sh(answers)
    assert result.returncode == 2 and message in result.stderr and result.stdout == ""
