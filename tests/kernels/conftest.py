"""Kernel tests run in Triton's interpreter on CPU tensors.

Triton decides interpreted-or-compiled when a kernel is decorated, i.e. when the kernel
modules are imported, so the variable is set here, at conftest import, before any test
module of this folder imports them. Nothing outside this folder imports the kernel modules
(the torch backend never loads Triton), so the order holds in a whole-suite run too.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
