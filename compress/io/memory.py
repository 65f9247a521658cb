"""Giving the heap that large reads freed back to the operating system."""

import ctypes
import gc


def release_freed_memory() -> None:
    """Hand the heap that loading freed back to the OS (glibc ``malloc_trim``), so RSS shows what
    is live; reading a checkpoint calls it after each file, whose decoding leaves freed
    temporaries between live tensors."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
