"""Building and loading the CPU kernels.

cpu_kernels.c (the arithmetic: plain C with AVX-512 or AVX2 intrinsics), collectives.c (all-reduce and gathers
between the ranks of one machine through shared memory) and torch_ops.cpp (thin torch operators around them) are
compiled at first use with the machine's compilers, `-O3 -march=native -fopenmp` against torch's own
headers (about 6 seconds), into $ACCESSORY_CACHE/kernels/<hash of sources, compilers, torch and CPU>/, and loaded
with torch.ops.load_library. They share torch's OpenMP runtime (both use libgomp.so.1), so torch.set_num_threads
sets their threads too. Loading a library runs its code, so a cached one is loaded only from folders private to this
user (accessory.cache_dir.untrusted); in a shared or world-writable cache the kernels are built again in a private
temporary folder, with a warning naming what is wrong. Without a compiler, every caller takes its portable torch
path instead (dispatch.py).
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from accessory.cache_dir import cache_dir, cache_folder, scratch_folder, untrusted

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(name) for name in ("cpu_kernels.c", "collectives.c", "torch_ops.cpp")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC"]
LIBRARY = "libaccessory_kernels.so"
ONE_ROW_CHOICE = "one_row_float32.json"  # beside the library: whether one float32 row goes to the kernel here

_library: Optional[Path] = None
_tried = False
_one_row_kernel = False
_int8x = False
_int8x_products = True  # GGUF products may take x in int8 (set_int8x_products); the library learns it as it loads


def cpu_kernels() -> bool:
    """Whether the CPU kernels are loaded (building them on first use); False, with one warning, if they cannot
    be built here."""
    global _library, _tried
    if not _tried:
        _tried = True
        try:
            path = _build()
            torch.ops.load_library(str(path))
            torch.library.register_fake("accessory::quantized_linear_cpu")(
                lambda x, fmt, q, scale, minimum: x.new_empty(x.shape[0], q.shape[0]))
            torch.library.register_fake("accessory::dequantize_gguf_cpu")(
                lambda q, fmt, features: q.new_empty(q.shape[0], features, dtype=torch.float32))
            torch.library.register_fake("accessory::gguf_int8x_linear_cpu")(
                lambda x, fmt, q: x.new_empty(x.shape[0], q.shape[0]))
            torch.library.register_fake("accessory::int4_int8x_linear_cpu")(
                lambda x, q, scale, minimum, outputs: x.new_empty(x.shape[0], outputs))
            torch.library.register_fake("accessory::linear_cpu")(lambda x, w: x.new_empty(x.shape[0], w.shape[0]))
            torch.library.register_fake("accessory::decode_attention_cpu")(lambda q, k, v, pos: q.new_empty(q.shape))
            torch.library.register_fake("accessory::rms_norm_cpu")(lambda x, w, eps, offset: x.new_empty(x.shape))
            torch.library.register_fake("accessory::rotary_cpu")(lambda x, rotations: x.new_empty(x.shape))
            torch.library.register_fake("accessory::shm_all_reduce")(lambda x, group, timeout_s: torch.empty_like(x))
            torch.library.register_fake("accessory::shm_all_gather")(
                lambda x, group, world, timeout_s: x.new_empty(world, *x.shape))
            _library = path
            global _one_row_kernel, _int8x
            _one_row_kernel = _one_row_choice(path.parent)
            _int8x = bool(ctypes.CDLL(str(path)).accessory_int8x())
            ctypes.CDLL(str(path)).accessory_set_int8x_one_row(int(_int8x_products))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("quantized CPU kernels unavailable (%s); using dequantize + matmul, which is slower", e)
    return _library is not None


def loaded() -> bool:
    """Whether the kernels are loaded already (without building them): what a compiled graph may call."""
    return _library is not None


def one_row_float_kernel() -> bool:
    """Whether a product of one float32 row (batch-1 decode) runs faster in the kernel than in the BLAS library's
    matrix-vector product on this machine. Machines differ: on an AMD EPYC here the kernel streams W 2-2.5x faster
    (AVX-512 and AVX2 builds alike), on the Intel Xeon of earlier figures it was 15% slower. Timed once per machine
    (the kernels' folder) and kept in one_row_float32.json there; False without the kernels."""
    return _one_row_kernel


def _one_row_choice(folder: Path) -> bool:
    """The recorded choice in `folder`, or, the first time, a timing of both, recorded (atomically; a folder that
    cannot be written is timed again by the next process)."""
    record = folder / ONE_ROW_CHOICE
    try:
        return bool(json.loads(record.read_text())["kernel"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    kernel_ms, blas_ms = _time_one_row()
    choice = {"kernel": kernel_ms < blas_ms, "kernel_ms": kernel_ms, "blas_ms": blas_ms,
              "threads": torch.get_num_threads()}
    try:
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as out:
            json.dump(choice, out)
        os.replace(out.name, record)
    except OSError:
        pass
    log.info("one float32 row: the kernel %.2f ms, the BLAS library %.2f ms per 16 MiB weight: %s", kernel_ms,
             blas_ms, "the kernel" if choice["kernel"] else "the BLAS library")
    return choice["kernel"]


def _time_one_row(rounds: int = 5) -> tuple[float, float]:
    """Median ms of one row of x times a 16 MiB float32 W^T, in the kernel and in F.linear: four weights in turn,
    64 MiB in all, so that each streams from memory as a model's weights do."""
    weights = [torch.ones(4096, 1024) for _ in range(4)]
    x = torch.ones(1, 1024)
    times: dict[str, list[float]] = {"kernel": [], "blas": []}
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first round is not counted (pages faulted in, code warm)
            for name, product in (("kernel", torch.ops.accessory.linear_cpu), ("blas", torch.nn.functional.linear)):
                start = time.perf_counter()
                for w in weights:
                    product(x, w)
                times[name].append((time.perf_counter() - start) / len(weights) * 1e3)
    return statistics.median(times["kernel"][1:]), statistics.median(times["blas"][1:])


def library_path() -> Optional[Path]:
    """The loaded library (for its plain C functions, through ctypes), building it first if needed; None without."""
    return _library if cpu_kernels() else None


def set_int8x_products(enabled: bool) -> None:
    """Whether a GGUF block format's products may take x in int8 (off with exact products: dispatch.exact_products):
    read by dispatch.py for a prompt's, and by the library for one row against Q5_0, Q4_K or Q6_K. Process-wide."""
    global _int8x_products
    _int8x_products = enabled
    if _library is not None:
        ctypes.CDLL(str(_library)).accessory_set_int8x_one_row(int(enabled))


def int8x_products() -> bool:
    """What set_int8x_products said last (a plain global, which torch.compile reads)."""
    return _int8x_products


def int8x_kernels() -> bool:
    """Whether the kernels have the products with x quantized to int8 (built for AVX-512 or AVX2): a draft's int4
    products and a prompt's GGUF block formats. A plain global once loaded, which torch.compile reads."""
    return _int8x if loaded() else cpu_kernels() and _int8x


def kernel_isa() -> str:
    """The instruction set the CPU kernels were built for ("avx512", "avx2" or "generic"), or "none"."""
    if not cpu_kernels():
        return "none"
    isa = ctypes.CDLL(str(_library)).accessory_kernels_isa  # the library torch loaded, not a second copy
    isa.restype = ctypes.c_char_p
    return isa().decode()


# ---- building ---------------------------------------------------------------------------------------------------

def _build() -> Path:
    """The library to load: the cached one, built first if needed; or, if the cache could hold a library another
    user wrote, one built in a private temporary folder."""
    key = _library_key()
    try:
        folder = cache_folder("kernels", key)
        doubt = untrusted(folder / LIBRARY if (folder / LIBRARY).exists() else folder, cache_dir() / "kernels")
    except OSError as e:
        folder, doubt = cache_dir() / "kernels" / key, f"it cannot be used ({e})"
    if doubt is not None:
        private = Path(tempfile.mkdtemp(prefix="accessory-kernels-"))
        atexit.register(shutil.rmtree, private, ignore_errors=True)
        log.warning("not loading the CPU kernels cached in %s: %s; building them in %s instead (once per process: "
                    "make the cache private to you, chmod 700, to keep them)", folder, doubt, private)
        return _compile(private)
    target = folder / LIBRARY
    if not target.is_file():
        log.info("building the quantized CPU kernels into %s (once per machine)", folder)
        # Ranks may build at once: each works in its own folder, then renames its library into place (same bytes).
        with scratch_folder(folder) as work:
            os.replace(_compile(work), target)
    return target


def _library_key() -> str:
    """A hash of what the library's bytes depend on: sources, compilers, flags, torch and the CPU."""
    cc, cxx = _compiler("CC", "cc", "gcc"), _compiler("CXX", "c++", "g++")
    versions = [subprocess.run([c, "--version"], capture_output=True, text=True, check=True).stdout for c in (cc, cxx)]
    return hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES), *versions, " ".join(FLAGS), _abi_flag(),
                                     torch.__version__, _cpu_signature()]).encode()).hexdigest()[:16]


def _compile(work: Path) -> Path:
    """Compile the library into the folder `work`; its path."""
    cc, cxx = _compiler("CC", "cc", "gcc"), _compiler("CXX", "c++", "g++")
    torch_dir = Path(torch.__file__).parent
    *c_sources, cpp_source = SOURCES
    objects, library = [work / f"{source.stem}.o" for source in c_sources], work / LIBRARY
    for source, obj in zip(c_sources, objects):
        _run([cc, *FLAGS, "-c", str(source), "-o", str(obj)])
    _run([cxx, *FLAGS, "-std=c++17", _abi_flag(), "-shared", f"-I{torch_dir / 'include'}", str(cpp_source),
          *map(str, objects), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", "-o", str(library)])
    library.chmod(0o700)  # writable by no one else whatever the umask, or the next process would not load it
    return library


def _abi_flag() -> str:
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"


def _compiler(variable: str, *names: str) -> str:
    found = os.environ.get(variable) or next((shutil.which(n) for n in names if shutil.which(n)), None)
    if found is None:
        raise RuntimeError(f"no C/C++ compiler ({' or '.join(names)}) on PATH")
    return found


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:2])} ... failed: {result.stderr.strip()[-800:]}")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor()
