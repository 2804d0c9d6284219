"""Builds and calls the CPU C kernels: decode attention (`kernels/cpu_decode.c`) and the
GGUF dequant-matmul for decoding (`kernels/cpu_gguf.c`, see `gguf_matmul` below).

The decode kernel reads K and V in place through the block tables, where the torch path
(`cpu_attention.py`) first gathers every sequence's blocks into a contiguous copy and then
runs SDPA: a W64 decode step takes 25 ms with it against 31 ms (fp32), 18.5 against 51 ms
(bf16; `python -m bench.decode_step`).

It is plain C with OpenMP and no torch headers or intrinsics beyond `#ifdef`-guarded ones,
so building it takes about a second with the system's C compiler (`cc`, or `$CC`), and it
is compiled for the machine it runs on: `-march=native` (AVX2 code on a Zen 3, AVX-512 on a
Zen 4), else `-mcpu=native` (compilers for ARM that lack -march=native), else the
compiler's baseline; the build logs which. The library is cached under
`$PAGEMESH_KERNEL_CACHE` (default `~/.cache/pagemesh/kernels`), keyed by the source, the
compiler flags and the CPU's feature flags (native code must not run on another CPU model
sharing the same home directory). Without a compiler, `available()` is False and the torch
path is used; `build_error()` says why. The kernel's OpenMP threads are torch's own (the library links
libgomp.so.1, which resolves to the copy torch loaded), `torch.get_num_threads()` of them:
a separate pool of Python threads fought torch's spinning OpenMP workers for the two
cores and made the kernel slower than the torch path it replaces.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kernels.cpu_features import cpu_features, cpu_identity

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")  # and its sibling C files (SOURCES)
# Reassociation lets the compiler vectorize the dot products; -ffast-math as a whole would
# also assume no infinities, and the online softmax starts from -inf.
CFLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno",
          "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast"]
# Tried in order until the compiler accepts one: code for this CPU, or portable code.
NATIVE_ARCH_FLAGS = (("-march=native",), ("-mcpu=native",), ())
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

# The C files and what each needs beyond CFLAGS. cpu_gguf.c dequantizes with gguf's exact
# fp32 arithmetic, and the fused elementwise ops (`cpu_fused.py`) round as torch's separate
# ops do, so no multiply-add may be fused there.
_TORCH_ROUNDING = ["-ffp-contract=off"]
SOURCES = {"cpu_decode": [], "cpu_gguf": _TORCH_ROUNDING, "cpu_rmsnorm": _TORCH_ROUNDING,
           "cpu_rotary": _TORCH_ROUNDING, "cpu_silu_mul": [], "cpu_store_kv": [],
           "cpu_argmax": []}
HEADERS = sorted(Path(__file__).parent.glob("cpu_*.h"))  # part of every library's cache key
_SIGNATURES = {
    "paged_decode": [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                     ctypes.c_float, ctypes.c_int, ctypes.c_int],
    "gguf_matmul": [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                    ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_int],
    "add_rms_norm": [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float, ctypes.c_int],
    "rotary_inplace": [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int,
                       ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_long, ctypes.c_int],
    "silu_mul": [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                 ctypes.c_int],
    "argmax_rows": [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                    ctypes.c_int],
    "store_kv": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                 ctypes.c_int],
}

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}
_failed: dict[str, str] = {}


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(name: str = "cpu_decode", arch_flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """Build (or load from the cache) kernel library `name`. `arch_flags` None: the first of
    NATIVE_ARCH_FLAGS the compiler accepts; a tuple (e.g. ("-march=x86-64-v3",)): exactly
    that target, which tests use to check each ISA level's code against the reference."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    if arch_flags is not None:
        return _build_with(cc, name, arch_flags)
    errors = []
    for choice in NATIVE_ARCH_FLAGS:
        try:
            lib = _build_with(cc, name, choice)
        except RuntimeError as error:
            errors.append(str(error))
            continue
        if choice != NATIVE_ARCH_FLAGS[0]:
            logger.warning("%s built with %s (the compiler refused %s)", name,
                           " ".join(choice) or "no arch flag", NATIVE_ARCH_FLAGS[0][0])
        logger.info("native CPU kernel %s: %s %s, for %s", name, cc, " ".join(choice),
                    cpu_features().one_line())
        return lib
    raise RuntimeError("; ".join(errors))


def _build_with(cc: str, name: str, arch_flags: tuple[str, ...]) -> ctypes.CDLL:
    source = SOURCE.with_name(f"{name}.c")
    flags = [*CFLAGS, *arch_flags, *SOURCES[name]]  # later flags win (-ffp-contract)
    key = hashlib.sha256(source.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
                         + " ".join(flags).encode() + cpu_identity().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PAGEMESH_KERNEL_CACHE",
                                Path.home() / ".cache" / "pagemesh" / "kernels"))
    library = cache / f"{name}-{key}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # Built beside its final name and renamed: processes starting together never load
        # a half-written library.
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            subprocess.run([cc, *flags, "-o", str(partial), str(source), "-lm"],
                           check=True, capture_output=True, text=True, timeout=120)
            partial.replace(library)
        except subprocess.CalledProcessError as error:
            raise RuntimeError(f"{cc} {' '.join(arch_flags)} failed: "
                               f"{error.stderr.strip()[:500]}") from error
        finally:
            partial.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(library))
    for function, argtypes in _SIGNATURES.items():
        if hasattr(lib, function):
            getattr(lib, function).restype = ctypes.c_int
            getattr(lib, function).argtypes = argtypes
    return lib


def library(name: str = "cpu_decode") -> ctypes.CDLL | None:
    """The built kernel library `name` (a key of SOURCES), or None (once logged) when it
    cannot be built here or PAGEMESH_NATIVE_KERNELS=0."""
    if os.environ.get("PAGEMESH_NATIVE_KERNELS", "1") == "0":
        return None
    with _lock:
        if name not in _libraries and name not in _failed:
            try:
                _libraries[name] = _build(name)
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                _failed[name] = str(error)
                logger.warning("native CPU kernels %s unavailable (%s); using torch ops",
                               name, _failed[name])
        return _libraries.get(name)


def build_error(name: str = "cpu_decode") -> str | None:
    """Why library `name` could not be built here (after a `library(name)` call), or None."""
    return _failed.get(name)


def available(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES and library() is not None


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None, *, lib: ctypes.CDLL | None = None
                 ) -> torch.Tensor:
    """One query token per sequence: query [S, H, D] -> [S, H, D], as the reference computes
    for q_len 1. Tensors must be CPU, fp32 or bf16 (`available`). `lib`: another build of
    cpu_decode (`_build(arch_flags=...)`), for tests; default the native one."""
    lib = lib or library()
    if lib is None or query.dtype not in _DTYPES:
        raise RuntimeError("the native decode kernel is not available for this input")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache halves must be contiguous")
    code = lib.paged_decode(
        _DTYPES[query.dtype], query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), out.data_ptr(), num_seqs,
        num_heads, num_kv_heads, head_dim, block_size, float(scale), int(sliding_window or 0),
        max(1, torch.get_num_threads()))
    if code:
        raise MemoryError("the native decode kernel could not allocate its scratch memory")
    return out


GGUF_TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
GGUF_MAX_ROWS = 16  # cpu_gguf.c's MAX_ROWS: more rows are compute-bound, better dequantized


def gguf_matmul(type_name: str, blocks: torch.Tensor, x: torch.Tensor, out: torch.Tensor,
                *, lib: ctypes.CDLL | None = None) -> bool:
    """out[:, :rows] = x @ W^T for W in GGUF blocks (uint8 [rows, bytes]); x and out fp32,
    contiguous, x with at most GGUF_MAX_ROWS rows. False (nothing written) when the kernel
    cannot do it here: no compiler, another type, too many rows. `lib`: as paged_decode's."""
    lib = lib or library("cpu_gguf")
    if (lib is None or type_name not in GGUF_TYPES or not 0 < x.shape[0] <= GGUF_MAX_ROWS
            or x.dtype != torch.float32 or out.dtype != torch.float32):
        return False
    code = lib.gguf_matmul(GGUF_TYPES[type_name], blocks.data_ptr(), blocks.shape[0],
                           x.shape[1], x.data_ptr(), x.shape[0], out.data_ptr(),
                           out.stride(0), max(1, torch.get_num_threads()))
    return code == 0
