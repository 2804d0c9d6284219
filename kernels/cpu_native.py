"""Builds and calls the CPU C kernels: decode attention (`kernels/cpu_decode.c`), the
GGUF dequant-matmul for decoding (`kernels/cpu_gguf.c`, see `gguf_matmul` below) and the fp32
linear layer on packed weight panels (`kernels/cpu_linear.c`, `linear_f32`).

The decode kernel reads K and V in place through the block tables, where the torch path
(`cpu_attention.py`) first gathers every sequence's blocks into a contiguous copy and then
runs SDPA: a W64 decode step measured faster with it in fp32 and far faster in bf16
(`python -m bench.decode_step`, which writes bench/results/decode_step.md).

It is plain C with OpenMP and no torch headers or intrinsics beyond `#ifdef`-guarded ones,
so building it is quick with the system's C compiler, and it is compiled for
the machine it runs on: `-march=native` (AVX2 code on a Zen 3, AVX-512 on a Zen 4), else
`-mcpu=native` (compilers for ARM that lack -march=native), else the compiler's baseline;
the build logs which. The library is cached in the configured folder, keyed by the source,
the compiler flags and the CPU's feature flags (native code must not run on another CPU
model sharing the same home directory). Without a compiler, `available()` is False and the
torch path is used; `build_error()` says why. The kernel's OpenMP threads are torch's own
(the library links libgomp.so.1, which resolves to the copy torch loaded),
`torch.get_num_threads()` of them: a separate pool of Python threads fought torch's
spinning OpenMP workers for the two cores and made the kernel slower than the torch path
it replaces.

Which compiler, which cache folder and whether the kernels are used at all is one frozen
`NativeKernelConfig`, read from the environment once (`native_kernel_config_from_env`:
`CC`, `PAGEMESH_KERNEL_CACHE`, `PAGEMESH_NATIVE_KERNELS=0`) by the entry points (the
worker's startup, `bench.decode_step`) and installed with `configure()`; until then the
defaults apply (`cc`/`gcc` on PATH, `~/.cache/pagemesh/kernels`, enabled). The config is
installed, not passed down, because the kernels are reached from inside every layer's
forward (norms, rotary, attention, GGUF matmuls, sampling) and are process-wide by nature:
one compiler, one CPU, one cache. Nothing here reads the environment.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.cpu_features import cpu_features, cpu_identity

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")  # and its sibling C files (SOURCES)
# Reassociation lets the compiler vectorize the dot products; -ffast-math as a whole would
# also assume no infinities, and the online softmax starts from -inf.
CFLAGS = [
    "-O3",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-ffp-contract=fast",
]
# Tried in order until the compiler accepts one: code for this CPU, or portable code.
NATIVE_ARCH_FLAGS = (("-march=native",), ("-mcpu=native",), ())
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

# The C files and what each needs beyond CFLAGS. cpu_gguf.c dequantizes with gguf's exact
# fp32 arithmetic, and the fused elementwise ops (`cpu_fused.py`) round as torch's separate
# ops do, so no multiply-add may be fused there.
_TORCH_ROUNDING = ["-ffp-contract=off"]
SOURCES = {
    "cpu_decode": [],
    "cpu_gguf": _TORCH_ROUNDING,
    "cpu_rmsnorm": _TORCH_ROUNDING,
    "cpu_rotary": _TORCH_ROUNDING,
    "cpu_silu_mul": [],
    "cpu_store_kv": [],
    "cpu_argmax": [],
    "cpu_token_mask": [],
    "cpu_linear": [],
    "cpu_lora": [],
}
HEADERS = sorted(Path(__file__).parent.glob("cpu_*.h"))  # part of every library's cache key
_SIGNATURES = {
    "paged_decode": [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ],
    "paged_attention": [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
    ],
    "gguf_matmul": [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_int,
    ],
    "add_rms_norm": [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_int,
    ],
    "rotary_inplace": [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_int,
    ],
    "silu_mul": [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_int,
    ],
    "argmax_rows": [
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_int,
    ],
    "apply_token_bitmask": [
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_int,
    ],
    "argmax_masked_rows": [
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_int,
    ],
    "linear_f32": [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ],
    "pack_f32": [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p],
    "linear_panel": [],
    "moe_f32": [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ],
    "lora_apply": [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_int,
    ],
    "store_kv": [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_int,
    ],
}


def find_compiler() -> str | None:
    """cc, else gcc, on PATH: the compiler when none is named."""
    return shutil.which("cc") or shutil.which("gcc")


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "pagemesh" / "kernels"


@dataclass(frozen=True)
class NativeKernelConfig:
    """How the C kernels are built and whether they are used; the defaults are what applies
    when no variable is set."""

    compiler: str | None = field(default_factory=find_compiler)  # None: no compiler here
    cache_dir: Path = field(default_factory=default_cache_dir)  # the built libraries
    enabled: bool = True  # False: always the torch ops (PAGEMESH_NATIVE_KERNELS=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))


def native_kernel_config_from_env(environ: Mapping[str, str]) -> NativeKernelConfig:
    """The config from `CC` (else cc/gcc on PATH), `PAGEMESH_KERNEL_CACHE` (else
    `~/.cache/pagemesh/kernels`) and `PAGEMESH_NATIVE_KERNELS` ("0" turns the kernels off);
    an empty variable counts as unset. Called once, by an entry point."""
    cache = environ.get("PAGEMESH_KERNEL_CACHE")
    return NativeKernelConfig(
        compiler=environ.get("CC") or find_compiler(),
        cache_dir=Path(cache) if cache else default_cache_dir(),
        enabled=environ.get("PAGEMESH_NATIVE_KERNELS", "1") != "0",
    )


_lock = threading.Lock()
_config: NativeKernelConfig | None = None  # None: the defaults, looked up on first use
_libraries: dict[str, ctypes.CDLL] = {}  # built with current_config()
_failed: dict[str, str] = {}
# What `library` answers without the lock: built and enabled under the installed config.
# A decode step asks a few hundred times (every fused op, every linear layer).
_ready: dict[str, ctypes.CDLL] = {}


def configure(config: NativeKernelConfig) -> NativeKernelConfig:
    """Install `config` for this process and return the one it replaces. Libraries built
    with another compiler or cache folder are dropped (the next call builds or loads them
    again); `enabled` alone keeps them."""
    global _config
    previous = current_config()
    with _lock:
        _config = config
        _ready.clear()
        if (config.compiler, config.cache_dir) != (previous.compiler, previous.cache_dir):
            _libraries.clear()
            _failed.clear()
    logger.info(
        "native CPU kernels: %s, compiler %s, cache %s",
        "enabled" if config.enabled else "disabled (PAGEMESH_NATIVE_KERNELS=0)",
        config.compiler or "none found",
        config.cache_dir,
    )
    return previous


def current_config() -> NativeKernelConfig:
    """The installed config, else the defaults (PATH searched once, here, not at import)."""
    global _config
    if _config is None:
        _config = NativeKernelConfig()
    return _config


def compiler() -> str | None:
    """The C compiler the kernels are built with (the installed config's)."""
    return current_config().compiler


def _build(
    name: str = "cpu_decode",
    arch_flags: tuple[str, ...] | None = None,
    config: NativeKernelConfig | None = None,
) -> ctypes.CDLL:
    """Build (or load from the cache) kernel library `name`. `arch_flags` None: the first of
    NATIVE_ARCH_FLAGS the compiler accepts; a tuple (e.g. ("-march=x86-64-v3",)): exactly
    that target, which tests use to check each ISA level's code against the reference.
    `config`: another compiler or cache folder than the installed one (tests)."""
    config = config or current_config()
    cc = config.compiler
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    if arch_flags is not None:
        return _build_with(cc, config.cache_dir, name, arch_flags)
    errors = []
    for choice in NATIVE_ARCH_FLAGS:
        try:
            lib = _build_with(cc, config.cache_dir, name, choice)
        except RuntimeError as error:
            errors.append(str(error))
            continue
        if choice != NATIVE_ARCH_FLAGS[0]:
            logger.warning(
                "%s built with %s (the compiler refused %s)",
                name,
                " ".join(choice) or "no arch flag",
                NATIVE_ARCH_FLAGS[0][0],
            )
        logger.info(
            "native CPU kernel %s: %s %s, for %s",
            name,
            cc,
            " ".join(choice),
            cpu_features().one_line(),
        )
        return lib
    raise RuntimeError("; ".join(errors))


def _build_with(cc: str, cache: Path, name: str, arch_flags: tuple[str, ...]) -> ctypes.CDLL:
    source = SOURCE.with_name(f"{name}.c")
    flags = [*CFLAGS, *arch_flags, *SOURCES[name]]  # later flags win (-ffp-contract)
    key = hashlib.sha256(
        source.read_bytes()
        + b"".join(h.read_bytes() for h in HEADERS)
        + " ".join(flags).encode()
        + cpu_identity().encode()
    ).hexdigest()[:16]
    library = cache / f"{name}-{key}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # Built beside its final name and renamed: processes starting together never load
        # a half-written library.
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            subprocess.run(
                [cc, *flags, "-o", str(partial), str(source), "-lm"],
                check=True,
                capture_output=True,
                text=True,
                timeout=120,
            )
            partial.replace(library)
        except subprocess.CalledProcessError as error:
            raise RuntimeError(
                f"{cc} {' '.join(arch_flags)} failed: {error.stderr.strip()[:500]}"
            ) from error
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
    cannot be built here or the installed config disables the kernels."""
    ready = _ready.get(name)
    if ready is not None:
        return ready
    if not current_config().enabled:
        return None
    with _lock:
        if name not in _libraries and name not in _failed:
            try:
                _libraries[name] = _build(name)
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                _failed[name] = str(error)
                logger.warning(
                    "native CPU kernels %s unavailable (%s); using torch ops", name, _failed[name]
                )
        lib = _libraries.get(name)
        if lib is not None and _config is not None and _config.enabled:
            _ready[name] = lib
        return lib


def build_error(name: str = "cpu_decode") -> str | None:
    """Why library `name` could not be built here (after a `library(name)` call), or None."""
    return _failed.get(name)


def available(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES and library() is not None


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    lib: ctypes.CDLL | None = None,
    split_keys: bool = True,
) -> torch.Tensor:
    """One query token per sequence: query [S, H, D] -> [S, H, D], as the reference computes
    for q_len 1. Tensors must be CPU, fp32 or bf16 (`available`). `lib`: another build of
    cpu_decode (`_build(arch_flags=...)`), for tests; default the native one. `split_keys`
    False keeps each sequence on one thread (the kernel before the KV split: benchmarks)."""
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
        _DTYPES[query.dtype],
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        float(scale),
        int(sliding_window or 0),
        max(1, torch.get_num_threads()),
        int(split_keys),
    )
    if code:
        raise MemoryError("the native decode kernel could not allocate its scratch memory")
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """A whole batch, decodes and prefills mixed, in one call: query [T, H, D] -> [T, H, D]
    as the reference computes it, every sequence's keys (this step's too) read from the
    cache. Tensors as `paged_decode`'s; `lib` as there."""
    lib = lib or library()
    if lib is None or query.dtype not in _DTYPES:
        raise RuntimeError("the native attention kernel is not available for this input")
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache halves must be contiguous")
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    code = lib.paged_attention(
        _DTYPES[query.dtype],
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        starts.data_ptr(),
        out.data_ptr(),
        lens.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        float(scale),
        int(sliding_window or 0),
        max(1, torch.get_num_threads()),
    )
    if code == -2:
        raise ValueError("a sequence has more query tokens than its context")
    if code:
        raise MemoryError("the native attention kernel could not allocate its scratch memory")
    return out


GGUF_TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
GGUF_MAX_ROWS = 16  # cpu_gguf.c's MAX_ROWS: more rows are compute-bound, better dequantized


def gguf_matmul(
    type_name: str,
    blocks: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor,
    *,
    lib: ctypes.CDLL | None = None,
) -> bool:
    """out[:, :rows] = x @ W^T for W in GGUF blocks (uint8 [rows, bytes]); x and out fp32,
    contiguous, x with at most GGUF_MAX_ROWS rows. False (nothing written) when the kernel
    cannot do it here: no compiler, another type, too many rows. `lib`: as paged_decode's."""
    lib = lib or library("cpu_gguf")
    if (
        lib is None
        or type_name not in GGUF_TYPES
        or not 0 < x.shape[0] <= GGUF_MAX_ROWS
        or x.dtype != torch.float32
        or out.dtype != torch.float32
    ):
        return False
    code = lib.gguf_matmul(
        GGUF_TYPES[type_name],
        blocks.data_ptr(),
        blocks.shape[0],
        x.shape[1],
        x.data_ptr(),
        x.shape[0],
        out.data_ptr(),
        out.stride(0),
        max(1, torch.get_num_threads()),
    )
    return code == 0


def pack_linear_f32(weight: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """W [n, k] fp32 -> cpu_linear.c's panels (a flat fp32 tensor of ceil(n / P) * k * P,
    P the build's panel width: 16 floats on AVX-512, else 8), for `linear_f32`. Raises when
    the kernel cannot be built here (`library("cpu_linear")`)."""
    lib = lib or library("cpu_linear")
    if lib is None or weight.dtype != torch.float32 or weight.dim() != 2:
        raise RuntimeError("the native linear kernel is not available for this weight")
    n, k = weight.shape
    weight = weight.contiguous()
    panel = lib.linear_panel()
    packed = torch.empty(-(-n // panel) * panel * k, dtype=torch.float32)
    lib.pack_f32(max(1, torch.get_num_threads()), weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def moe_f32(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    num_experts: int,
    intermediate: int,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """`kernels.moe.fused_experts` in one C call (cpu_linear.c's `moe_f32`), fp32: hidden
    [tokens, h]; the experts' gate|up and down weights each packed by `pack_linear_f32` and
    concatenated in expert order (`w13_packed`, `w2_packed`)."""
    lib = lib or library("cpu_linear")
    if lib is None:
        raise RuntimeError("the native linear kernel is not available")
    tokens, h = hidden.shape
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    x = hidden.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty((tokens, h), dtype=torch.float32)
    rows, down = torch.empty((pairs, h)), torch.empty((pairs, h))
    gate_up, act = torch.empty((pairs, 2 * intermediate)), torch.empty((pairs, intermediate))
    scratch = torch.empty(2 * pairs + 2 * (num_experts + 1), dtype=torch.int64)
    lib.moe_f32(
        torch.get_num_threads(),
        x.data_ptr(),
        tokens,
        h,
        ids.data_ptr(),
        weights.data_ptr(),
        top_k,
        num_experts,
        w13_packed.data_ptr(),
        w2_packed.data_ptr(),
        intermediate,
        out.data_ptr(),
        rows.data_ptr(),
        gate_up.data_ptr(),
        act.data_ptr(),
        down.data_ptr(),
        scratch.data_ptr(),
    )
    return out


def linear_f32(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [..., k] W^T + bias for W packed by `pack_linear_f32` ([n, k]): [..., n], fp32."""
    lib = lib or library("cpu_linear")
    if lib is None:
        raise RuntimeError("the native linear kernel is not available")
    k = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, k)
    if rows.dtype != torch.float32 or not rows.is_contiguous():
        rows = rows.to(torch.float32).contiguous()
    out = torch.empty((rows.shape[0], n), dtype=torch.float32)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.to(torch.float32).contiguous()
    lib.linear_f32(
        torch.get_num_threads(),
        rows.data_ptr(),
        rows.shape[0],
        k,
        packed.data_ptr(),
        n,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
    )
    if x.dim() == 2:
        return out
    return out.reshape(*x.shape[:-1], n)
