"""mergeflow.io.heap: a freed tensor-sized buffer goes back to the system (glibc's mmap threshold fixed)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

# A 20 MB buffer freed raises glibc's dynamic threshold; a 10 MB buffer then comes from the heap, and with a
# small block after it, freeing it leaves a hole the heap keeps. How much private memory the free gives back:
_PROBE = textwrap.dedent("""
    import sys
    from mergeflow.io.heap import return_large_buffers

    def rss_anon_kb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

    fixed = return_large_buffers() if sys.argv[1] == "fixed" else None
    first = bytearray(20 << 20)
    del first
    a = bytearray(10 << 20)
    b = bytearray(1000)
    before = rss_anon_kb()
    del a
    print(fixed, before - rss_anon_kb())
""")


def _probe(mode: str, **env: str) -> tuple[str, int]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], env={**environment, **env}, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0], int(out[1])


def test_a_freed_buffer_goes_back_to_the_system_with_the_threshold_fixed() -> None:
    fixed, returned_kb = _probe("fixed")
    assert fixed == "True" and returned_kb > 9 * 1024


def test_without_it_the_heap_keeps_the_freed_buffer() -> None:
    # What the export's memory grew by (637 MiB against 288 MiB at full scale): the probe's control.
    fixed, returned_kb = _probe("dynamic")
    assert fixed == "None" and returned_kb < 1024


def test_a_threshold_set_in_the_environment_is_left_as_it_is() -> None:
    fixed, _ = _probe("fixed", MALLOC_MMAP_THRESHOLD_="1048576")
    assert fixed == "False"


def test_the_console_script_fixes_it() -> None:
    code = textwrap.dedent("""
        import deployments.cli as cli
        import mergeflow.io.heap as heap
        calls = []
        heap.return_large_buffers = lambda: calls.append(1) or True
        cli.main = lambda: 0
        import atexit
        atexit.register(lambda: print("calls", len(calls)))
        cli.entry()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    assert "calls 1" in out
