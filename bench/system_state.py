"""What the machine brings to a timed run: how much of its input is in the page cache, and how much
written data the kernel still has to write back (a previous run's output competes for the disk); and what
a stretch of the run cost it (`traffic`: the disk's bytes, CPU in user code and in the kernel)."""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
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


@dataclass
class Traffic:
    """What a stretch of time cost the machine: the disk's bytes read and written, and CPU seconds in user
    code and in the kernel (all processes, kernel threads included), from /sys and /proc/stat counters."""

    disk_read: int = 0
    disk_written: int = 0
    user_s: float = 0.0
    system_s: float = 0.0  # system + irq + softirq: the kernel's share

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(self.disk_read - other.disk_read, self.disk_written - other.disk_written,
                       self.user_s - other.user_s, self.system_s - other.system_s)

    def summary(self) -> str:
        return (f"disk read {self.disk_read / 1e9:.1f} GB, written {self.disk_written / 1e9:.1f} GB; "
                f"CPU user {self.user_s:.0f} s, kernel {self.system_s:.0f} s")


def traffic(path: Path) -> Traffic:
    """The counters now, for the whole disk that holds `path` (0 where /sys or /proc cannot be read)."""
    read = written = 0
    dev = os.stat(path).st_dev
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    try:
        stat_file = block / "stat" if not (block / "partition").exists() else block.resolve().parent / "stat"
        fields = stat_file.read_text().split()
        read, written = int(fields[2]) * 512, int(fields[6]) * 512  # sectors of 512 bytes, whatever the device's
    except (OSError, IndexError, ValueError):
        pass
    user = system = 0.0
    try:
        with open("/proc/stat") as fh:
            ticks = [int(x) for x in fh.readline().split()[1:8]]
        hz = os.sysconf("SC_CLK_TCK")
        user, system = (ticks[0] + ticks[1]) / hz, (ticks[2] + ticks[5] + ticks[6]) / hz
    except (OSError, ValueError, IndexError):
        pass
    return Traffic(read, written, user, system)
