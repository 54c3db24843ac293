"""Hostile GGUF files end in a named error, never a traceback, a hang or gigabytes of memory (issue 40, items 1 and
2): each malformed header, metadata entry or value is built here (a tiny valid file from gguf's writer, then one
thing in it changed; or raw bytes), and the import (`read_gguf`, what `accessory convert gguf` and a direct
`--pretrained_path x.gguf` or draft model call) must raise CheckpointError or ConfigError naming the file, the key
and the value, within seconds. A fuzz test throws thousands of random headers and mutated files at it."""
from __future__ import annotations

import itertools
import os
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import accessory.checkpoint.importers.gguf as gguf_importer
from accessory.checkpoint.importers import expand_templates, expected_shapes, read_gguf
from accessory.checkpoint.importers.gguf import GGUF_TO_META, MAX_NESTING, check_layout
from accessory.errors import CheckpointError, ConfigError
from accessory.network.LLM.llama import ModelArgs

DIM, N_HEADS, N_KV_HEADS, N_LAYERS, HIDDEN, VOCAB = 8, 2, 1, 1, 16, 16
T = gguf.GGUFValueType
METADATA = {  # key -> (value, type): a valid tiny llama
    "llama.block_count": (N_LAYERS, T.UINT32), "llama.embedding_length": (DIM, T.UINT32),
    "llama.feed_forward_length": (HIDDEN, T.UINT32), "llama.attention.head_count": (N_HEADS, T.UINT32),
    "llama.attention.head_count_kv": (N_KV_HEADS, T.UINT32), "llama.context_length": (64, T.UINT32),
    "llama.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32), "llama.rope.freq_base": (10000.0, T.FLOAT32),
    "tokenizer.ggml.model": ("gpt2", T.STRING), "tokenizer.ggml.tokens": ([f"t{i}" for i in range(VOCAB)], T.ARRAY),
}
BIG = 1 << 60
ROOT = Path(__file__).resolve().parents[2]


def tiny_gguf(path: Path, changes: dict = None) -> Path:
    """A valid tiny llama GGUF (float32 tensors, tied embeddings) with `changes` {key: (value, type[, item type])}
    to its metadata."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, kind, *item) in {**METADATA, **(changes or {})}.items():
        writer.add_key_value(key, value, kind, *item)
    args = ModelArgs(dim=DIM, n_layers=N_LAYERS, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, vocab_size=VOCAB,
                     hidden_dim=HIDDEN)
    to_gguf = {ours: theirs for theirs, ours in expand_templates(GGUF_TO_META, N_LAYERS).items()}
    generator = np.random.default_rng(0)
    for name, shape in expected_shapes(args).items():
        if name != "output.weight":
            writer.add_tensor(to_gguf[name], generator.standard_normal(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def patched(path: Path, old: bytes, new: bytes) -> Path:
    """`path` with its one occurrence of `old` replaced by `new`."""
    data = path.read_bytes()
    assert data.count(old) == 1, (old, data.count(old))
    path.write_bytes(data.replace(old, new))
    return path


def string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def entry(key: bytes, kind: int, payload: bytes) -> bytes:
    return string(key) + struct.pack("<I", kind) + payload


def raw(n_tensors: int, n_keys: int, body: bytes = b"", version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_keys) + body


def timed_import(path: Path, workdir: Path):
    """read_gguf, timed: every refusal comes within 5 s."""
    start = time.perf_counter()
    try:
        return read_gguf(path, workdir)
    finally:
        assert time.perf_counter() - start < 5, f"{path}: took {time.perf_counter() - start:.1f} s"


def test_the_tiny_file_imports(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_importer, "_save_tokenizer", lambda *args: [])  # its toy vocabulary has no merges
    model = read_gguf(tiny_gguf(tmp_path / "m.gguf"), tmp_path / "tok")
    assert (model.config["dim"], model.config["n_heads"], model.config["vocab_size"]) == (DIM, N_HEADS, VOCAB)


# ---- item 1: a count the file cannot hold -------------------------------------------------------------------------

def test_an_array_of_2_60_values_is_refused_by_its_key(tmp_path):
    """The probe's file: gguf's reader looped once per declared element (2^60), growing to gigabytes."""
    path = tiny_gguf(tmp_path / "a.gguf", {"test.hostile": ([1, 2, 3, 4], T.ARRAY, T.UINT8),
                                          "test.filler": ("x" * 300_000, T.STRING)})
    patched(path, string(b"test.hostile") + struct.pack("<IIQ", T.ARRAY, T.UINT8, 4),
            string(b"test.hostile") + struct.pack("<IIQ", T.ARRAY, T.UINT8, BIG))
    with pytest.raises(CheckpointError, match=rf"a\.gguf: metadata key 'test\.hostile': an array of {BIG} UINT8 "
                                              rf"values: {BIG} bytes needed, but only \d+ remain"):
        timed_import(path, tmp_path / "tok")


# ---- item 2: what raised a traceback -------------------------------------------------------------------------------

HEADERS = {
    "magic only": (b"GGUF", r"4 bytes; a GGUF file starts with a 24-byte header"),
    "truncated header": (b"GGUF\x03\x00\x00\x00\x00", r"9 bytes; a GGUF file starts with a 24-byte header"),
    "empty": (b"", r"0 bytes; a GGUF file starts"),
    "not gguf": (b"PK\x03\x04" + bytes(40), r"starts with b'PK\\x03\\x04'; a GGUF file starts with b'GGUF'"),
    "version 1": (raw(0, 0, version=1), r"GGUF version 1; versions \[2, 3\] can be read"),
    "2^60 keys": (raw(0, BIG), rf"header: {BIG} metadata keys and 0 tensors; at most 1500000 and 65536"),
    "2^62 tensors": (raw(1 << 62, 0), rf"header: 0 metadata keys and {1 << 62} tensors"),
    "keys beyond the file": (raw(0, 1000), r"header: 1000 metadata keys: 13000 bytes needed, but only 0 remain"),
    "tensors beyond the file": (raw(3, 0), r"header: 3 tensors: 96 bytes needed, but only 0 remain"),
    "a key of 2^60 bytes": (raw(0, 1, struct.pack("<Q", BIG) + bytes(16)),
                            rf"metadata key #0's name is {BIG} bytes long; at most 65535"),
    "a string of 2^60 bytes": (raw(0, 1, entry(b"general.name", T.STRING, struct.pack("<Q", BIG) + b"ab")),
                               rf"metadata key 'general\.name': string #0 of 1 is {BIG} bytes long"),
    "2^61 strings": (raw(0, 1, entry(b"t", T.ARRAY, struct.pack("<IQ", T.STRING, 1 << 61))),
                     rf"metadata key 't': an array of {1 << 61} STRING values"),
    "an unknown value type": (raw(0, 1, entry(b"k", 13, bytes(8))), r"metadata key 'k' has value type 13"),
    "a key not UTF-8": (raw(0, 1, entry(b"\xff\xfe", T.UINT8, b"\x00")), r"metadata key #0's name: not UTF-8"),
    "a key twice": (raw(0, 2, entry(b"k", T.UINT8, b"\x00") * 2), r"metadata key 'k' appears twice"),
    "nested 20,000 deep": (raw(0, 1, entry(b"deep", T.ARRAY, struct.pack("<IQ", T.ARRAY, 1) * 20_000
                                          + struct.pack("<IQ", T.UINT8, 0))),
                           rf"metadata key 'deep' nests arrays more than {MAX_NESTING} deep"),
    "a bad alignment": (raw(0, 1, entry(b"general.alignment", T.UINT32, struct.pack("<I", 3))),
                        r"metadata key 'general\.alignment' must be a UINT32 power of two, got 3"),
    "a tensor of 5 dimensions": (raw(1, 0, string(b"w") + struct.pack("<I", 5) + bytes(60)),
                                 r"tensor 'w' has 5 dimensions; 1 to 4 were expected"),
    "a tensor of an unknown type": (raw(1, 0, string(b"w") + struct.pack("<IQIQ", 1, 4, 99, 0)),
                                    r"tensor 'w' has type 99; the known types are 0 \(F32\)"),
    "a tensor past the end": (raw(1, 0, string(b"w") + struct.pack("<IQIQ", 1, 1 << 40, 0, 0)),
                              r"tensor 'w' \(F32, dimensions \[1099511627776\]\) takes bytes 64 to \d+, past the end"),
}


@pytest.mark.parametrize("case", HEADERS)
def test_a_malformed_layout_is_refused_by_name(tmp_path, case):
    data, message = HEADERS[case]
    path = tmp_path / "h.gguf"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=rf"h\.gguf: {message}"):
        timed_import(path, tmp_path / "tok")


def test_a_file_cut_short_is_refused_naming_the_tensor(tmp_path):
    path = tiny_gguf(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: tensor 'blk\.0\.ffn_up\.weight' \(F32, "
                                              r"dimensions \[8, 16\]\) takes bytes \d+ to \d+, past the end of the "
                                              r"file .*cut short"):
        timed_import(path, tmp_path / "tok")


def test_an_architecture_not_utf8_is_refused_by_key(tmp_path):
    path = patched(tiny_gguf(tmp_path / "u.gguf"), string(b"llama"), string(b"\xffl\xfema"))
    with pytest.raises(CheckpointError, match=r"u\.gguf: metadata key 'general\.architecture': not UTF-8 text"):
        timed_import(path, tmp_path / "tok")


VALUES = {  # metadata changes -> the refusal's message
    "head_count 0": ({"llama.attention.head_count": (0, T.UINT32)},
                     r"llama\.attention\.head_count must be an integer \[1, 4096\], got 0"),
    "head_count a string": ({"llama.attention.head_count": ("4", T.STRING)},
                            r"llama\.attention\.head_count must be an integer \[1, 4096\], got '4'"),
    "embedding_length a string": ({"llama.embedding_length": ("8", T.STRING)},
                                  r"llama\.embedding_length must be an integer \[1, 131072\], got '8'"),
    "head_count_kv 0": ({"llama.attention.head_count_kv": (0, T.UINT32)},
                        r"llama\.attention\.head_count_kv must be an integer \[1, 4096\], got 0"),
    "head_count_kv not dividing": ({"llama.attention.head_count_kv": (3, T.UINT32)},
                                   r"llama\.attention\.head_count 2 is not a multiple of "
                                   r"llama\.attention\.head_count_kv 3"),
    "heads not dividing dim": ({"llama.attention.head_count": (3, T.UINT32)},
                               r"llama\.embedding_length 8 is not a multiple of llama\.attention\.head_count 3"),
    "yarn factor 0": ({"llama.rope.scaling.type": ("yarn", T.STRING), "llama.rope.scaling.factor": (0.0, T.FLOAT32),
                       "llama.rope.scaling.original_context_length": (32, T.UINT32)},
                      r"llama\.rope\.scaling\.factor must be a finite number > 0\.0, got 0\.0"),
    "yarn factor NaN": ({"llama.rope.scaling.type": ("yarn", T.STRING),
                         "llama.rope.scaling.factor": (float("nan"), T.FLOAT32)},
                        r"llama\.rope\.scaling\.factor must be a finite number > 0\.0, got nan"),
    "epsilon infinite": ({"llama.attention.layer_norm_rms_epsilon": (float("inf"), T.FLOAT32)},
                         r"llama\.attention\.layer_norm_rms_epsilon must be a finite number >= 1e-30 and <= 0\.1, "
                         r"got inf"),
    "block_count 2^32-1": ({"llama.block_count": ((1 << 32) - 1, T.UINT32)},
                           r"llama\.block_count must be an integer \[1, 1024\], got 4294967295"),
    "block_count beyond the tensors": ({"llama.block_count": (1000, T.UINT32)},
                                       r"llama\.block_count 1000 asks for more layers than the file's 11 tensors"),
    "expert_count a float": ({"llama.expert_count": (2.5, T.FLOAT32)},
                             r"llama\.expert_count must be an integer \[0, 4096\], got 2\.5"),
    "architecture a number": ({"general.architecture": (7, T.UINT32)},
                              r"general\.architecture must be text of at most 64 characters, got 7"),
    "nested array": ({"llama.context_length": ([[1]], T.ARRAY)}, r"metadata key 'llama\.context_length' holds "
                                                                  r"nested arrays"),
}


@pytest.mark.parametrize("case", VALUES)
def test_a_bad_metadata_value_is_refused_by_key_and_value(tmp_path, case):
    changes, message = VALUES[case]
    path = tiny_gguf(tmp_path / "v.gguf", changes)
    with pytest.raises((ConfigError, CheckpointError), match=rf"v\.gguf: {message}"):
        timed_import(path, tmp_path / "tok")


# ---- the command line ----------------------------------------------------------------------------------------------

def accessory(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ACCESSORY_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "accessory", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)


@pytest.mark.parametrize("verb", ["convert", "inspect"])
def test_convert_and_inspect_refuse_the_2_60_array_by_name(tmp_path, verb):
    """convert: exit 2 and the error on stderr; inspect reports it as the file's problem (stdout, exit 1: its
    health-check convention)."""
    path = tmp_path / "a.gguf"
    path.write_bytes(raw(0, 1, entry(b"test.hostile", T.ARRAY, struct.pack("<IQ", T.UINT8, BIG)) + bytes(1000)))
    args = ["convert", "gguf", str(path), str(tmp_path / "out")] if verb == "convert" else ["inspect", str(path)]
    done = accessory(tmp_path, *args)
    assert done.returncode == (2 if verb == "convert" else 1), done.stderr[-2000:]
    said = done.stderr if verb == "convert" else done.stdout
    assert f"metadata key 'test.hostile': an array of {BIG} UINT8 values" in said
    assert "Traceback" not in done.stderr + done.stdout


def test_generate_refuses_head_count_0_with_exit_2(tmp_path):
    """A direct --pretrained_path x.gguf (and a draft model, which loads the same way) imports the file first."""
    path = tiny_gguf(tmp_path / "h0.gguf", {"llama.attention.head_count": (0, T.UINT32)})
    done = accessory(tmp_path, "generate", "--pretrained_path", str(path), "--prompt", "hi", "--max_gen_len", "1")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "h0.gguf: llama.attention.head_count must be an integer [1, 4096], got 0" in done.stderr
    assert "Traceback" not in done.stderr


# ---- real files ----------------------------------------------------------------------------------------------------

def test_the_layout_check_is_fast_on_real_files(smollm2_gguf, gemma3_gguf):
    """Gemma 3's metadata holds a 262k-token vocabulary: its walk takes tens of milliseconds."""
    for path in (smollm2_gguf, gemma3_gguf):
        start = time.perf_counter()
        check_layout(path)
        assert time.perf_counter() - start < 1.0, path


# ---- fuzz ----------------------------------------------------------------------------------------------------------

class Hung(BaseException):
    """An example that ran past its time (BaseException: no `except` in the importer may turn it into a refusal)."""


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@dataclass(frozen=True)
class Valid:
    """The tiny file's bytes; where its metadata types and scalar values lie; where its tensor data begins."""
    data: bytes
    types: list  # offsets of each metadata entry's value type (u32)
    values: list  # (offset, size) of each scalar metadata value
    data_start: int


@pytest.fixture(scope="module")
def valid(scratch) -> Valid:
    path = tiny_gguf(scratch / "valid.gguf")
    reader = gguf.GGUFReader(path)
    fields = [field for name, field in reader.fields.items() if not name.startswith("GGUF.")]
    types = [field.offset + 8 + len(field.name.encode()) for field in fields]
    values = [(at + 4, int(field.parts[-1].nbytes)) for field, at in zip(fields, types)
              if field.types[0] not in (T.STRING, T.ARRAY)]
    return Valid(path.read_bytes(), types, values, reader.data_offset)


FILES = itertools.count()
COUNTS = st.one_of(st.integers(0, 4), st.sampled_from([1 << k for k in (16, 31, 32, 40, 60, 62, 63)] + [2**64 - 1]),
                   st.integers(0, 2**64 - 1))


def import_or_refuse(scratch: Path, data: bytes) -> None:
    """The file `data` imports (the tokenizer step, transformers' own, left out) or is refused by name; anything
    else, or more than 10 s, fails."""
    path = scratch / f"{next(FILES)}.gguf"
    path.write_bytes(data)

    def hung(*_):
        raise Hung(f"{path}: still importing after 10 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, 10)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gguf_importer, "_save_tokenizer", lambda *args: [])
            read_gguf(path, scratch / "tok")
    except (CheckpointError, ConfigError) as e:
        assert str(e).startswith(str(path)), e
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        path.unlink()


def mostly(draw, usual, other):
    """`usual` nine times in ten, else a draw of `other`: hostile files are mostly almost right."""
    return usual if draw(st.integers(0, 9)) else draw(other)


@st.composite
def values(draw, depth: int = 0) -> bytes:
    """A metadata value's type and bytes: well formed or not, nested, with counts the file may not hold."""
    kind = mostly(draw, draw(st.sampled_from([T.ARRAY, T.ARRAY, T.ARRAY, T.STRING, *range(13)])),
                  st.integers(0, 2**32 - 1))
    if kind == T.STRING:
        text = draw(st.binary(max_size=12))
        return struct.pack("<IQ", kind, mostly(draw, len(text), COUNTS)) + text
    if kind == T.ARRAY:
        if depth < 10 and draw(st.booleans()):
            inner = draw(st.lists(values(depth + 1), max_size=3))  # elements of mixed types, as a hostile file's
            item = inner[0][:4] if inner else struct.pack("<I", draw(st.integers(0, 12)))
            count = mostly(draw, len(inner), COUNTS)
            return struct.pack("<I", kind) + item + struct.pack("<Q", count) + b"".join(v[4:] for v in inner)
        item, count = draw(st.integers(0, 13)), draw(COUNTS)
        return struct.pack("<IIQ", kind, item, count) + draw(st.binary(max_size=16))
    return struct.pack("<I", kind) + draw(st.binary(max_size=8))


@st.composite
def tensor_entries(draw) -> bytes:
    name, dims = draw(st.binary(max_size=6)), draw(st.lists(st.one_of(st.just(32), COUNTS), max_size=5))
    n_dims = mostly(draw, len(dims), st.integers(0, 2**32 - 1))
    offset = mostly(draw, 0, COUNTS)
    return (string(name) + struct.pack("<I", n_dims) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", draw(st.integers(0, 40)), offset))


@st.composite
def headers(draw) -> bytes:
    """A GGUF header, metadata entries and tensor entries built from random parts, sometimes cut short."""
    magic = mostly(draw, b"GGUF", st.binary(min_size=4, max_size=4))
    version = mostly(draw, 3, st.one_of(st.sampled_from([1, 2, 3 << 24]), st.integers(0, 2**32 - 1)))
    names = st.one_of(st.sampled_from([b"general.architecture", b"llama.block_count", b"general.alignment"]),
                      st.text(max_size=8).map(str.encode), st.binary(max_size=8))
    keys = draw(st.lists(st.tuples(names, values()), min_size=1, max_size=4))
    tensors = draw(st.lists(tensor_entries(), max_size=3))
    body = b"".join(string(key) + value for key, value in keys) + b"".join(tensors)
    n_tensors, n_keys = mostly(draw, len(tensors), COUNTS), mostly(draw, len(keys), COUNTS)
    data = magic + struct.pack("<IQQ", version, n_tensors, n_keys) + body + draw(st.binary(max_size=256))
    return data[:draw(st.integers(0, len(data)))] if draw(st.integers(0, 3)) == 0 else data


@settings(max_examples=1200, deadline=3000, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(headers())
def test_any_header_is_read_or_refused_by_name(scratch, data):
    import_or_refuse(scratch, data)


INTERESTING = [0, 1, 2, 3, 7, 8, 9, 12, 13, 255, 1 << 31, 2**32 - 1, 1 << 60, 1 << 62, 2**64 - 1]
SPECIAL_FLOATS = [0.0, -1.0, 1e-45, 1e30, float("nan"), float("inf"), -float("inf")]


@st.composite
def number_bytes(draw, size: int) -> bytes:
    """`size` bytes of an interesting integer, float or random bits."""
    how = draw(st.sampled_from(["int", "float", "bits"]))
    if how == "int":
        return (draw(st.sampled_from(INTERESTING)) % 2 ** (8 * size)).to_bytes(size, "little")
    if how == "float" and size in (4, 8):
        return struct.pack("<f" if size == 4 else "<d", draw(st.sampled_from(SPECIAL_FLOATS)))
    return draw(st.binary(min_size=size, max_size=size))


@st.composite
def mutations(draw, valid: Valid) -> bytes:
    """The valid tiny file with a metadata value or type changed, bytes or 4/8-byte numbers overwritten (mostly in
    its header, metadata and tensor index), bytes inserted or deleted, or cut short."""
    data = bytearray(valid.data)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["value", "value", "type", "byte", "u32", "u64", "insert", "delete"]))
        at = draw(st.one_of(st.integers(4, valid.data_start), st.integers(0, len(data) - 1)))
        if how == "value":
            at, size = draw(st.sampled_from(valid.values))
            data[at:at + size] = draw(number_bytes(size))
        elif how == "type":
            at = draw(st.sampled_from(valid.types))
            data[at:at + 4] = struct.pack("<I", mostly(draw, draw(st.integers(0, 12)), st.integers(0, 2**32 - 1)))
        elif how in ("byte", "u32", "u64"):
            size = {"byte": 1, "u32": 4, "u64": 8}[how]
            data[at:at + size] = draw(number_bytes(size))
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at:at + draw(st.integers(1, 8))]
    return bytes(data[:draw(st.integers(0, len(data)))] if draw(st.integers(0, 9)) == 0 else data)


@settings(max_examples=1000, deadline=3000, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_mutation_of_a_valid_file_is_read_or_refused_by_name(scratch, valid, data):
    import_or_refuse(scratch, data.draw(mutations(valid)))
