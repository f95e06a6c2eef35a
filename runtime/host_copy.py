"""Host-to-device copies that do not stop the host.

A blocking copy from ordinary (pageable) host memory to a CUDA device waits for every kernel
already queued on the stream before it starts, and the host waits for the copy: each one is a
full device sync. A round's metadata is dozens of small host tensors (positions, index
pointers, tree masks, slot ids), so blocking copies serialize the host with the device, and
the device idles while the host prepares each next piece. These copies go through pinned
memory instead and return at once: the stream runs them in order before the kernels that read
them, and PyTorch's pinned-memory cache keeps each source block until its copy has run. On a
CPU they are the plain ``.to`` / ``copy_``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for a CUDA device goes without a sync."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor_on(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device`` (`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; from the host to a CUDA device without a sync."""
    if dst.device.type == "cuda" and src.device.type == "cpu":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
