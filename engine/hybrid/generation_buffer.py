"""Memory for the hybrid engine's transitions: a persistent generation buffer, huge pages.

No rank keeps two copies of the actor: the generation buffer holds memory only while the
actor generates, the training weights only while it trains. :class:`GenerationBuffer` is built
once (the generation model's parameters are views of it for the whole run) and only gives its
memory back between generations, so no transition allocates or maps a model-sized block:

* CPU: one anonymous mapping for the engine's life; ``release`` is ``madvise(MADV_DONTNEED)``
  (the kernel takes the pages back, the addresses stay), ``acquire`` costs nothing (pages
  fault in as the merge writes them).
* CUDA: the storage is resized to 0 and back; PyTorch's caching allocator hands the same
  block back (no ``cudaMalloc`` after the first transition unless another allocation took it:
  the fragmentation risk listed in BENCHMARKS.md).

On CPU the cost that remains is the kernel mapping fresh pages on first touch: measured on the
2-core dev box, 1.77 GB took 0.9-1.5 s to fill with fresh 4 KiB pages versus 0.13 s once
mapped. Transparent huge pages (``MADV_HUGEPAGE``, honoured when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``) cut that to ~0.2 s;
they are asked for on the buffer and on the training weights' re-grown storage.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Optional

import torch

HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_libc: Optional[ctypes.CDLL] = None


def _madvise(address: int, length: int) -> bool:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):  # not Linux / no libc: plain pages, still correct
        return False


def advise_huge_pages(storage: torch.UntypedStorage) -> bool:
    """Ask for huge pages on the 2 MiB-aligned interior of a CPU storage *before* it is
    first touched. Returns whether the kernel accepted the advice (False is harmless)."""
    if storage.device.type != "cpu" or storage.nbytes() < 2 * HUGE_PAGE:
        return False
    start = storage.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
    return last > first and _madvise(first, last - first)


class GenerationBuffer:
    """A flat ``numel`` buffer of ``dtype`` on ``device`` whose memory comes and goes.

    ``tensor`` (and every view of it) stays valid for the object's life; its contents are
    undefined after :meth:`release` until written again.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, torch.device(device)
        self.nbytes = numel * dtype.itemsize
        self._region: Optional[mmap.mmap] = None
        if self.device.type == "cpu" and self.nbytes > 0:
            self._region = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if self.nbytes >= 2 * HUGE_PAGE:
                try:
                    self._region.madvise(_MADV_HUGEPAGE)
                except (AttributeError, OSError):
                    pass
            # frombuffer keeps the mapping alive for as long as any view of the tensor exists.
            self.tensor = torch.frombuffer(self._region, dtype=dtype, count=numel)
        else:
            self.tensor = torch.empty(numel, dtype=dtype, device=self.device)
            self.tensor.untyped_storage().resize_(0)
        self.held = False

    def acquire(self) -> torch.Tensor:
        """Back the buffer with memory again; returns :attr:`tensor`."""
        if not self.held:
            if self._region is None:
                self.tensor.untyped_storage().resize_(self.nbytes)
            self.held = True
        return self.tensor

    def release(self) -> None:
        """Give the buffer's memory back (the views stay valid, their contents do not)."""
        if not self.held:
            return
        if self._region is None:
            self.tensor.untyped_storage().resize_(0)
        else:
            self._region.madvise(mmap.MADV_DONTNEED)
        self.held = False
