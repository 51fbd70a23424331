"""Runs a script under the Triton interpreter (TRITON_INTERPRET=1: Triton kernels execute on the CPU with numpy), in
a subprocess because the variable is read when Triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PATCH = """
import numpy as np
import triton.runtime.interpreter as interpreter
# Triton 3.6's interpreter turns 1-element arrays into ints with int(array), which NumPy >= 2.4 refuses.
_patch = interpreter._patch_lang_tensor
def _patched(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
interpreter._patch_lang_tensor = _patched
"""


def run_interpreted(script: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", PATCH + textwrap.dedent(script)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip


def use_small_draft_kernel() -> None:
    """In an interpreted script: the drafter's attention through the Triton kernel, as the GPU form calls it (one
    request: heads folded, kernel, unfolded; several: the kernel's batched form) but with small tiles, which the
    interpreter runs quickly."""
    from models.dflash import DraftAttention, KernelDraftAttention

    DraftAttention.kernel_config = {"block_m": 16, "block_n": 16, "num_warps": 1, "num_stages": 1}
    KernelDraftAttention.kernel_config = DraftAttention.kernel_config
    DraftAttention.attend_rows = KernelDraftAttention.attend_rows
    DraftAttention.attend_requests = KernelDraftAttention.attend_requests
