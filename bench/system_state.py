"""What the machine brings to a timed run: how much of its input is in the page cache, and how much
written data the kernel still has to write back (a previous run's output competes for the disk)."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_LIBC = ctypes.CDLL(None, use_errno=True)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache now: mincore(2) over a read-only mapping, which reads nothing."""
    size = path.stat().st_size
    if size == 0:
        return 0
    _LIBC.mmap.restype = ctypes.c_void_p
    _LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vector = (ctypes.c_ubyte * ((size + _PAGE - 1) // _PAGE))()
            if _LIBC.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        finally:
            _LIBC.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return min(sum(flag & 1 for flag in vector) * _PAGE, size)


def resident_fraction(paths: list[Path]) -> float:
    total = sum(p.stat().st_size for p in paths)
    return sum(resident_bytes(p) for p in paths) / total if total else 1.0


def unwritten_mb() -> float:
    """Dirty + Writeback from /proc/meminfo: data written but not yet on the disk, in MB."""
    fields: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Dirty", "Writeback"):
            fields[name] = int(rest.split()[0])
    return sum(fields.values()) * 1024 / 1e6
