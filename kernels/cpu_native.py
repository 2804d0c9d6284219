"""Builds and loads the CPU C kernels (`kernels/cpu_*.c`, one library per file: `SOURCES`).
The ops that call them are ctypes wrappers beside their C files: `cpu_decode.py` (decode and
mixed-batch attention), `cpu_gguf.py` (the GGUF dequant-matmul), `cpu_linear.py` (the fp32
linear layer on packed panels, MoE experts), `cpu_fused.py` (the elementwise ops, argmax,
token masks) and `lora.py`; each asks `library(name)` for its build. The functions' ctypes
signatures are `cpu_signatures.py`'s.

It is plain C with OpenMP and no torch headers or intrinsics beyond `#ifdef`-guarded ones,
so building it is quick with the system's C compiler, and it is compiled for
the machine it runs on: `-march=native` (AVX2 code on a Zen 3, AVX-512 on a Zen 4), else
`-mcpu=native` (compilers for ARM that lack -march=native), else the compiler's baseline;
the build logs which. The library is cached in the configured folder, keyed by the source,
the compiler flags and the CPU's feature flags (native code must not run on another CPU
model sharing the same home directory). Without a compiler, `library()` is None and the
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

from kernels.cpu_features import cpu_features, cpu_identity
from kernels.cpu_signatures import SIGNATURES

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
    for function, argtypes in SIGNATURES.items():
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
