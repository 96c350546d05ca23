"""Triton kernels for the engine's hot paths, each beside the torch reference it is tested against.

Importing this package never imports triton: the kernel modules do, and callers import them
lazily, only after `triton_available` said yes, so CPU-only installs never pay for (or
break on) triton. On the CPU the kernels run under triton's interpreter (TRITON_INTERPRET=1),
which is how tests/kernels checks them without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch


def triton_available(device: torch.device | str) -> bool:
    """True when Triton kernels can run on tensors on `device`.

    That is on CUDA with an active triton driver, or anywhere under the interpreter
    (TRITON_INTERPRET=1, which must be set before triton is first imported).
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _triton_importable()
    return torch.device(device).type == "cuda" and _triton_driver_active()


def use_triton(x: torch.Tensor) -> bool:
    """Whether the model runs its Triton kernels on x: CUDA tensors, triton installed. Never CPU
    tensors, even under TRITON_INTERPRET=1 (the kernel tests): there the torch reference is the path."""
    return x.is_cuda and triton_available(x.device)


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _triton_driver_active() -> bool:
    if not _triton_importable():
        return False
    import triton

    try:
        # Raises "0 active drivers" on a machine without a GPU back end.
        triton.runtime.driver.active.get_current_target()
    except RuntimeError:
        return False
    return True
