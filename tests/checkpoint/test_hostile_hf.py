"""Hostile Hugging Face model folders end in a named error, never a traceback (issue 40, items 3, 4 and 9): a tiny
valid Llama folder is built, one thing in it corrupted per case, and the import (`read_hf`, the direct load's
`imported`, `accessory convert hf` / `accessory inspect`) must raise ConfigError or CheckpointError naming the file,
the key and the value. A fuzz test throws random config.json values at the config mapping; the import cache key
(`_identity`) must see a source replaced with content of the same size and modification time."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from accessory.checkpoint.direct import _identity, imported, source_kind
from accessory.checkpoint.importers import read_hf
from accessory.checkpoint.importers.common import validated_args
from accessory.checkpoint.importers.families import hf_family
from accessory.checkpoint.importers.hf import config_from_hf
from accessory.errors import CheckpointError, ConfigError
from accessory.network.components import rope_frequencies

DIM, HEADS, KV_HEADS, LAYERS, HIDDEN, VOCAB = 16, 2, 1, 1, 24, 32
HEAD_DIM = DIM // HEADS
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": DIM,
          "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
          "intermediate_size": HIDDEN, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 64, "tie_word_embeddings": False}
DELETE = object()  # a config change that removes the key
ROOT = Path(__file__).resolve().parents[2]


def hf_weights() -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's tensors for CONFIG, by HF name."""
    shapes = {"model.embed_tokens.weight": (VOCAB, DIM), "model.norm.weight": (DIM,), "lm_head.weight": (VOCAB, DIM)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        shapes.update({f"{layer}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, DIM),
                       f"{layer}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, DIM),
                       f"{layer}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, DIM),
                       f"{layer}.self_attn.o_proj.weight": (DIM, HEADS * HEAD_DIM),
                       f"{layer}.mlp.gate_proj.weight": (HIDDEN, DIM), f"{layer}.mlp.up_proj.weight": (HIDDEN, DIM),
                       f"{layer}.mlp.down_proj.weight": (DIM, HIDDEN), f"{layer}.input_layernorm.weight": (DIM,),
                       f"{layer}.post_attention_layernorm.weight": (DIM,)})
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def write_config(folder: Path, **changes) -> Path:
    config = {**CONFIG, **changes}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not DELETE}))
    return folder


def tiny_hf_folder(folder: Path, **changes) -> Path:
    """A valid HF Llama folder (config.json and model.safetensors), with `changes` made to its config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(hf_weights(), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return write_config(folder, **changes)


@pytest.fixture
def folder(tmp_path) -> Path:
    return tiny_hf_folder(tmp_path / "hf")


def test_the_tiny_folder_imports(folder):
    model = read_hf(folder)
    assert model.config["dim"] == DIM and len(model.state_dict) == len(hf_weights())


# ---- config.json values -------------------------------------------------------------------------------------------

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
GEMMA = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "sliding_window": 4}

# (changes to config.json, error, what the message must say)
CONFIG_CASES = {
    "heads-zero": ({"num_attention_heads": 0}, ConfigError,
                   r"config\.json: num_attention_heads must be an integer \[1, 4096\], got 0$"),
    "hidden-size-string": ({"hidden_size": "16"}, ConfigError,
                           r"config\.json: hidden_size must be an integer \[1, 131072\], got '16'$"),
    "yarn-negative-original": ({"rope_scaling": {**YARN, "original_max_position_embeddings": -8}}, ConfigError,
                               r"config\.json: rope_scaling yarn original_max_position_embeddings must be in "
                               r"\[1, 16777216\], got -8$"),
    "linear-factor-string": ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, ConfigError,
                             r"config\.json: rope_scaling linear factor must be a number in \[1e-06, 1000000\.0\], "
                             r"got '2'$"),
    "linear-factor-nan": ({"rope_scaling": {"rope_type": "linear", "factor": math.nan}}, ConfigError,
                          r"config\.json: rope_scaling linear factor must be a number .*, got nan$"),
    "linear-factor-zero": ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, ConfigError,
                           r"config\.json: rope_scaling linear factor must be in \[1e-06, 1000000\.0\], got 0$"),
    "linear-factor-negative": ({"rope_scaling": {"type": "linear", "factor": -1.0}}, ConfigError,
                               r"config\.json: rope_scaling linear factor must be in .*, got -1\.0$"),
    "llama3-empty-band": ({"rope_scaling": {**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 2.0}}, ConfigError,
                          r"config\.json: rope_scaling llama3 low_freq_factor \(2\.0\) must be less than "
                          r"high_freq_factor \(2\.0\)$"),
    "rope-scaling-string": ({"rope_scaling": "linear"}, ConfigError,
                            r"config\.json: rope_scaling must be an object, got 'linear'$"),
    "rope-type-list": ({"rope_scaling": {"rope_type": ["linear"], "factor": 2.0}}, ConfigError,
                       r"config\.json: rope scaling type \['linear'\] is not supported"),
    "rope-theta-string": ({"rope_theta": "1e4"}, ConfigError,
                          r"config\.json: rope_theta must be a finite number >= 1\.0 and <= 1000000000000\.0, "
                          r"got '1e4'$"),
    "full-attention-list": ({"rope_parameters": {"full_attention": [1]}}, ConfigError,
                            r"config\.json: rope_parameters\.full_attention must be an object, got \[1\]$"),
    "kv-heads-zero": ({"num_key_value_heads": 0}, ConfigError,
                      r"config\.json: num_key_value_heads must be an integer \[1, 4096\], got 0$"),
    "kv-heads-not-dividing": ({"num_key_value_heads": 3}, ConfigError,
                              r"config\.json: n_heads \(2\) must be divisible by n_kv_heads \(3\)$"),
    "heads-not-dividing": ({"num_attention_heads": 3}, ConfigError,
                           r"config\.json: dim \(16\) must be divisible by n_heads \(3\), or head_dim given$"),
    "head-dim-zero": ({"head_dim": 0}, ConfigError, r"config\.json: head_dim must be an integer \[2, 4096\], got 0$"),
    "layers-huge": ({"num_hidden_layers": 10 ** 30}, ConfigError,
                    r"config\.json: num_hidden_layers must be an integer \[1, 1024\], got 10{30}$"),
    "norm-eps-infinite": ({"rms_norm_eps": math.inf}, ConfigError,
                          r"config\.json: rms_norm_eps must be a finite number .*, got inf$"),
    "positions-float": ({"max_position_embeddings": 1e30}, ConfigError,
                        r"config\.json: max_position_embeddings must be an integer \[1, 16777216\], got 1e\+30$"),
    "tie-string": ({"tie_word_embeddings": "false"}, ConfigError,
                   r"config\.json: tie_word_embeddings must be true or false, got 'false'$"),
    "architectures-object": ({"architectures": [{}]}, CheckpointError, r"config\.json: architectures is \[\{\}\]"),
    "model-type-list": ({"architectures": DELETE, "model_type": ["llama"]}, CheckpointError,
                        r"config\.json: architectures is None"),
    "layer-types-objects": ({"layer_types": [{}]}, ConfigError,
                            r"config\.json: layer_types must be a list of \['full_attention', 'sliding_attention'\]"),
    "window-negative": ({"sliding_window": -1}, ConfigError,
                        r"config\.json: sliding_window must be an integer \[1, 16777216\], got -1$"),
    "text-config-string": ({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": "x"}, ConfigError,
                           r"config\.json: text_config must be an object .*, got 'x'$"),
    "gemma-pattern-zero": ({**GEMMA, "sliding_window_pattern": 0}, ConfigError,
                           r"config\.json: sliding_window_pattern must be an integer \[1, 1024\], got 0$"),
    "gemma-local-theta-string": ({**GEMMA, "rope_local_base_freq": "x"}, ConfigError,
                                 r"config\.json: rope_local_base_freq must be a finite number .*, got 'x'$"),
    "moe-experts-string": ({"architectures": ["MixtralForCausalLM"], "num_local_experts": "8",
                            "num_experts_per_tok": 2}, ConfigError,
                           r"config\.json: num_local_experts must be an integer \[1, 4096\], got '8'$"),
    "hidden-act-huge": ({"hidden_act": "x" * 10 ** 6}, ConfigError, r"config\.json: hidden_act 'x{76}\.\.\. is not"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_a_hostile_config_value_is_refused_by_name(tmp_path, case):
    changes, error, message = CONFIG_CASES[case]
    folder = tiny_hf_folder(tmp_path / "hf", **changes)
    with pytest.raises(error, match=message) as raised:
        read_hf(folder)
    assert type(raised.value) is error and len(str(raised.value)) < 1000


LLAVA = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}


@pytest.mark.parametrize("config, preprocessor, message", [
    ({**LLAVA, "text_config": "x"}, None, r"config\.json: text_config must be an object, got 'x'$"),
    ({**LLAVA, "vision_config": [1]}, None, r"config\.json: vision_config must be an object, got \[1\]$"),
    ({**LLAVA, "image_token_index": "5"}, None,
     r"config\.json: image_token_index must be an integer >= 0, got '5'$"),
    ({**LLAVA, "vision_config": {"model_type": "no_such_tower"}}, None, r"config\.json: not a readable LlavaConfig"),
    (LLAVA, {"image_mean": 0.5}, r"preprocessor_config\.json: image_mean must be a list of numbers, one per "
                                 r"channel, got 0\.5$"),
    (LLAVA, {"image_std": [0.5, "x", 0.5]}, r"preprocessor_config\.json: image_std must be a finite number, got 'x'$"),
], ids=["text-config", "vision-config", "image-token", "unknown-tower", "mean-number", "std-string"])
def test_a_hostile_llava_config_is_refused_by_name(tmp_path, config, preprocessor, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if preprocessor is not None:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    with pytest.raises(ConfigError, match=message):
        read_hf(tmp_path)


def test_a_deeply_nested_config_is_refused_through_the_direct_load(folder, tmp_path, monkeypatch):
    """A config.json nested 100,000 deep beside HF weights: ConfigError naming it, both from the importer and from
    the direct load, which must not mistake the folder for another kind (nor hit a RecursionError)."""
    monkeypatch.setenv("ACCESSORY_CACHE", str(tmp_path / "cache"))
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    for load in (read_hf, imported, source_kind):
        with pytest.raises(ConfigError, match=r"config\.json: JSON nested 100000 deep; at most 64"):
            load(folder)


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe{}", r"config\.json: cannot be read as JSON \('utf-8' codec"),
    (b"[1, 2]", r"config\.json: expected a JSON object, found list"),
    (b'{"hidden_size": ', r"config\.json: cannot be read as JSON"),
])
def test_a_config_that_is_not_a_json_object_is_refused(folder, content, message):
    (folder / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        read_hf(folder)
    with pytest.raises(ConfigError, match=message):
        source_kind(folder)


# ---- weight files -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("index", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
@pytest.mark.parametrize("name, message", [
    ("../../../../etc/passwd", r"'\.\./\.\./\.\./\.\./etc/passwd' is outside .*; only files inside the folder"),
    ("/etc/passwd", r"'/etc/passwd' is outside"),
    (["model.safetensors"], r"expected a file name inside .*, got \['model\.safetensors'\]"),
    ("", r"expected a file name inside .*, got ''"),
])
def test_an_index_naming_a_file_outside_the_folder_is_refused(folder, index, name, message):
    """A weight_map entry is opened only if it names a file inside the folder."""
    if index.startswith("pytorch"):
        (folder / "model.safetensors").unlink()
    weight_map = {"model.norm.weight": name, "lm_head.weight": "model.safetensors"}
    (folder / index).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=rf"{index.replace('.', '[.]')}: weight_map: {message}"):
        read_hf(folder)


def safetensors_bytes(header: bytes, length: int | None = None, data: bytes = b"") -> bytes:
    return (len(header) if length is None else length).to_bytes(8, "little") + header + data


@pytest.mark.parametrize("content, message", [
    (b"\x01\x00", r"2 bytes; a safetensors file starts with an 8-byte header length"),
    (safetensors_bytes(b"{}", length=1 << 40), r"safetensors header length 1099511627776 exceeds the 2 bytes after"),
    (safetensors_bytes(b"{}", length=2 ** 64 - 1), r"safetensors header length 18446744073709551615 exceeds"),
    (safetensors_bytes(b'{"a": "\xff"}'), r"safetensors header: not UTF-8 text"),
    (safetensors_bytes(b'{"a": '), r"safetensors header: cannot be read as JSON"),
    (safetensors_bytes(b"[]"), r"safetensors header: expected a JSON object, found list"),
    (safetensors_bytes(b"[" * 1000 + b"]" * 1000), r"safetensors header: JSON nested 1000 deep"),
    (safetensors_bytes(b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1000]}}'),
     r"cannot read as safetensors"),
], ids=["short", "length-past-end", "length-max", "not-utf8", "not-json", "not-object", "deep", "offsets-past-end"])
def test_a_hostile_safetensors_header_is_refused(folder, content, message):
    (folder / "model.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: {message}"):
        read_hf(folder)


# ---- the command line ---------------------------------------------------------------------------------------------

def accessory(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "accessory", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)


def test_the_cli_names_the_bad_value(tmp_path):
    """`accessory convert hf` exits 2 with the message; `accessory inspect` lists it as a problem (and exits 1, or 2
    for a file it cannot describe at all); neither prints a traceback."""
    folder = tiny_hf_folder(tmp_path / "hf", num_attention_heads=0)
    converted = accessory("convert", "hf", str(folder), str(tmp_path / "out"))
    assert converted.returncode == 2, converted.stderr
    assert "config.json: num_attention_heads must be an integer [1, 4096], got 0" in converted.stderr
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../../etc/passwd"}}))
    write_config(folder)
    inspected = accessory("inspect", str(folder))
    assert inspected.returncode in (1, 2), inspected.stderr
    assert ("model.safetensors.index.json: weight_map: '../../../etc/passwd' is outside"
            in inspected.stdout + inspected.stderr)
    assert "Traceback" not in converted.stderr + inspected.stderr + inspected.stdout


# ---- the import cache key -----------------------------------------------------------------------------------------

def rewritten_in_place(path: Path, content: bytes) -> None:
    """`content` (of the same size) written over `path`, its modification time put back."""
    stat = path.stat()
    assert len(content) == stat.st_size
    path.write_bytes(content)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_the_cache_key_sees_content_of_the_same_size_and_time(tmp_path, folder):
    """A GGUF (or a folder's config.json) replaced by other bytes of the same length, its mtime restored, is a new
    source: it is imported again, not served from the old import."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100_000))
    before = _identity(gguf)
    assert _identity(gguf) == before
    rewritten_in_place(gguf, b"GGUF" + bytes(50_000) + b"\x01" + bytes(49_999))
    assert _identity(gguf) != before
    before = _identity(folder)
    config = (folder / "config.json").read_bytes()
    rewritten_in_place(folder / "config.json", config.replace(b'"rms_norm_eps": 1e-05', b'"rms_norm_eps": 2e-05'))
    assert _identity(folder) != before


# ---- fuzz: any config.json imports its config or is refused by name ------------------------------------------------

SOURCE = "/models/hostile/config.json"
ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
                 "Gemma3ForConditionalGeneration", "MixtralForCausalLM", "Qwen3MoeForCausalLM"]
# Every key the config mapping reads (hf.py config_from_hf, families.py), and those of rope scaling.
READ_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "head_dim", "tie_word_embeddings",
             "attention_bias", "mlp_bias", "hidden_act", "sliding_window", "use_sliding_window", "layer_types",
             "max_window_layers", "model_type", "architectures", "use_bidirectional_attention",
             "attn_logit_softcapping", "hidden_activation", "sliding_window_pattern", "rope_local_base_freq",
             "query_pre_attn_scalar", "final_logit_softcapping", "num_local_experts", "num_experts",
             "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
             "decoder_sparse_step", "shared_expert_intermediate_size", "rope_parameters", "rope_scaling"]
ROPE_KEYS = ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "attention_factor",
             "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"]

LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2 ** 80, 2 ** 80), st.floats(),
                   st.text(max_size=6), st.sampled_from(["silu", "linear", "llama3", "yarn", "sliding_attention"]))
JSON_VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=4) | st.sampled_from(ROPE_KEYS + ["rope_type", "full_attention"]), inner, max_size=3),
    max_leaves=6)
PLAUSIBLE = st.sampled_from([0, 1, 2, 3, 4, 8, 16, 32, 64, -1, 2.0, 0.5, 1e-6, 2 ** 31, 10 ** 30, math.nan,
                             math.inf, -math.inf, "16", True, None])
VALUES = PLAUSIBLE | JSON_VALUES
ROPE_NUMBERS = (st.sampled_from([0.5, 1, 2.0, 4.0, 8.0, 32, 1024, 8192]) | st.floats() | st.integers(-4, 1 << 25)
                | st.sampled_from([0, -1.0, math.nan, math.inf, "2", None, True, [2.0]])).map(lambda x: x)


def mostly(valid: st.SearchStrategy, other: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` three times in four (one_of picks its flattened branches alike; a mapped `other` stays one)."""
    return st.one_of(valid, valid, valid, other)


# Each rope type's keys as HF writes them (required, optional), and valid values of each, drawn `mostly`: many drawn
# scalings are valid, and the others are wrong in one or two values.
ROPE_TYPE_KEYS = {"linear": (["factor"], []),
                  "llama3": (["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
                             []),
                  "yarn": (["factor", "original_max_position_embeddings"],
                           ["attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"])}
ROPE_VALID = {"factor": st.floats(0.25, 64.0), "low_freq_factor": st.floats(0.5, 2.0),
              "high_freq_factor": st.floats(2.5, 8.0), "original_max_position_embeddings": st.integers(16, 1 << 17),
              "attention_factor": st.floats(0.5, 2.0), "beta_fast": st.floats(8.0, 64.0),
              "beta_slow": st.floats(0.5, 4.0), "mscale": st.floats(0.0, 2.0), "mscale_all_dim": st.floats(0.0, 2.0),
              "truncate": st.booleans()}
TYPED_SCALINGS = [st.fixed_dictionaries({"rope_type": st.just(kind),
                                         **{k: mostly(ROPE_VALID[k], ROPE_NUMBERS) for k in needed}},
                                        optional={k: mostly(ROPE_VALID[k], ROPE_NUMBERS) for k in optional})
                  for kind, (needed, optional) in ROPE_TYPE_KEYS.items()]
ANY_SCALING = st.fixed_dictionaries(
    {"rope_type": st.sampled_from(["linear", "llama3", "yarn", "default", "dynamic", None, 3, ["yarn"]])},
    optional={key: ROPE_NUMBERS for key in ROPE_KEYS + ["type"]})
ROPE_SCALING = st.one_of(st.none(), *TYPED_SCALINGS, ROPE_NUMBERS, ANY_SCALING)


@st.composite
def hf_configs(draw) -> dict:
    """A valid tiny config of some family, with up to three of the keys the mapping reads made hostile (often
    none), sometimes one dropped, and random rope scaling (in transformers 4's or 5's place)."""
    architecture = draw(st.sampled_from(ARCHITECTURES))
    hf = {**CONFIG, "architectures": [architecture], "num_local_experts": 4, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    hostile = draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))
    for key in draw(st.lists(st.sampled_from(READ_KEYS), min_size=hostile, max_size=hostile, unique=True)):
        hf[key] = draw(VALUES)
    if draw(st.sampled_from([False] * 9 + [True])):
        hf.pop(draw(st.sampled_from(READ_KEYS)), None)
    scaling = draw(ROPE_SCALING)
    if isinstance(scaling, dict) and draw(st.booleans()):
        hf["rope_parameters"] = {**scaling, "rope_theta": draw(mostly(st.floats(1e3, 1e7), ROPE_NUMBERS))}
    else:
        hf["rope_scaling"] = scaling
    if architecture == "Gemma3ForConditionalGeneration" and draw(st.booleans()):
        hf = {"architectures": hf.pop("architectures", None), "text_config": hf}
    return hf


def check_mapped(hf: dict) -> None:
    """The config mapping of `hf` and its ModelArgs: ConfigError / CheckpointError naming SOURCE, or a model whose
    rotary frequencies are finite and positive."""
    try:
        family = hf_family(hf, SOURCE)
        args = validated_args(config_from_hf(hf, SOURCE), SOURCE, family.llama_type)
    except (ConfigError, CheckpointError) as e:
        assert str(e).startswith(SOURCE) and len(str(e)) < 1000, str(e)[:2000]
        return
    for window in {None, args.sliding_window}:
        freqs, scale = rope_frequencies(args.head_dim, *args.rope(window))
        assert bool(torch.isfinite(freqs).all() and (freqs > 0).all()) and math.isfinite(scale), (hf, args)


@settings(max_examples=2500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(hf_configs())
def test_any_config_json_is_mapped_or_refused_by_name(hf):
    check_mapped(json.loads(json.dumps(hf)))  # as a file holds it: NaN and Infinity included
