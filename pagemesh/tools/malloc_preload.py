"""Which malloc `pagemesh up` preloads into its CPU workers (`--malloc`).

glibc's malloc returns freed memory to the system and takes it back in small pieces; a
worker allocating and freeing a step's activations every few milliseconds from two OpenMP
threads pays for that, and vLLM's CPU docs preload tcmalloc for it. `auto` preloads
tcmalloc (Debian's libtcmalloc-minimal4), else jemalloc (libjemalloc2), when one is
installed, and nothing otherwise: an allocator is never required. A preload the caller
already set (LD_PRELOAD in up's environment) is kept after ours.
"""

from __future__ import annotations

import os
from pathlib import Path

MALLOC_CHOICES = ("auto", "tcmalloc", "jemalloc", "system")
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)
LIBRARIES = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
    "jemalloc": ("libjemalloc.so.2",),
}


def find_malloc(choice: str, library_dirs: tuple[str, ...] = LIBRARY_DIRS) -> Path | None:
    """The shared library `choice` names (auto: tcmalloc, else jemalloc), None for system or
    when auto finds neither. Raises ValueError for an unknown choice or a named allocator
    that is not installed."""
    if choice not in MALLOC_CHOICES:
        raise ValueError(f"--malloc must be one of {', '.join(MALLOC_CHOICES)}, got {choice!r}")
    if choice == "system":
        return None
    for name in ("tcmalloc", "jemalloc") if choice == "auto" else (choice,):
        for folder in library_dirs:
            for library in LIBRARIES[name]:
                path = Path(folder) / library
                if path.exists():
                    return path
    if choice != "auto":
        raise ValueError(
            f"--malloc {choice}: none of {', '.join(LIBRARIES[choice])} in "
            f"{', '.join(library_dirs)} (Debian: apt install "
            f"{'libtcmalloc-minimal4' if choice == 'tcmalloc' else 'libjemalloc2'})"
        )
    return None


def preload_env(library: Path | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The LD_PRELOAD a worker starts with: `library` first, then whatever the caller
    preloads already; {} when there is nothing to add."""
    if library is None:
        return {}
    current = (os.environ if environ is None else environ).get("LD_PRELOAD", "")
    return {"LD_PRELOAD": ":".join(p for p in (str(library), current) if p)}
