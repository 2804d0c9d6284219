"""Every kernel variant compiles for sm_90a (H100/H200) without spilling registers, checked
on this GPU-less machine with Triton's compiler and bundled ptxas (see compile_sm90.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

triton = pytest.importorskip("triton")

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel has no bundled ptxas")
def test_kernels_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier cache
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_sm90"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
