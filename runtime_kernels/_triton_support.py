"""What the Triton modules of ``runtime_kernels`` share: interpreter detection, one interpreter fix,
the scaled ``q·kᵀ`` tile helper, the arrival counters of last-program reductions and the check for
programmatic dependent launch. Imported only by those modules (it needs triton).

Without a GPU, the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``; ``tests/conftest.py``
sets it on CPU-only machines), so CI exercises the same kernel code a GPU compiles.

Triton 3.6's interpreter turns a scalar into a Python int with ``int(ndarray of shape (1,))``, which
numpy >= 2.4 refuses, so ``for t in range(a, n)`` with a loaded or computed ``n`` fails on the CPU
(triton-lang/triton#9171, fixed upstream by a ``squeeze()``). :func:`patch_interpreter` applies that
one-line fix once per process, and only under the interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# triton.runtime.interpreter and triton.language.extra.cuda are imported where used: the first only under
# the CPU interpreter, the second only when a CUDA device asks; a GPU process never loads the interpreter.


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_COUNTERS: dict[tuple[str, str], torch.Tensor] = {}


def arrival_counters(owner: str, device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters of ``owner``'s kernels (the last program of a group to arrive does
    the group's reduction and resets its counter): one buffer per (owner, device), at least ``n`` long.

    No per-call memset, and a CUDA-graph capture reuses the buffer of the eager warm-up. The interpreter
    can stop mid-grid on an exception (a GPU launch cannot), so there it is zeroed every call. Two
    launches of one owner running concurrently on different streams of one device would share it: don't.
    """
    key = (owner, str(device))
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    elif device.type != "cuda":
        buf.zero_()
    return buf


def patch_interpreter() -> None:
    """Apply the triton-lang/triton#9171 fix to the interpreter (idempotent; no-op when compiling)."""
    if not interpreting():
        return
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(interpreter, "_calib_index_patch", False):
        return  # another Triton release: its interpreter has its own (fixed) scalar conversion

    def patched(tensor, scope):  # noqa: ANN001, ANN202 - triton's internal signature
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
    interpreter._calib_index_patch = True


@triton.jit
def scaled_scores(q, kk, sm_scale, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``(q @ kkᵀ) · sm_scale`` for a ``[M, D]`` query tile and ``[N, D]`` key tile, fp32 accumulation.
    ``UPCAST``: operands to fp32 first (the interpreter's bf16 dot is wrong); ``IEEE``: exact fp32 dot."""
    if UPCAST:
        q = q.to(tl.float32)
        kk = kk.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(kk), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kk))
    return s * sm_scale


_PDL: dict[str, bool] = {}


def pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and later, compiled kernels only): a kernel launched with
    ``launch_pdl=True`` may start once every program of the kernel before it has executed
    ``gdc_launch_dependents`` (or exited), and must ``gdc_wait`` before it reads what that kernel writes.
    False under the interpreter, on the CPU, before sm_90, or when this Triton lacks the GDC ops."""
    if interpreting() or device.type != "cuda":
        return False
    key = str(device)
    if key not in _PDL:
        try:
            from triton.language.extra import cuda as tl_cuda

            ok = (hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")
                  and torch.cuda.get_device_capability(device)[0] >= 9)
        except (ImportError, RuntimeError):
            ok = False
        _PDL[key] = ok
    return _PDL[key]
