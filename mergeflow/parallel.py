"""Per-element work spread over the machine's cores, its results taken back in order.

The GGUF check (`gguf_quant.scan_stored`: `test`'s and the staged check's gguf-py dequantize of every
tensor) works segment by segment; the segments are independent, only the digests they feed must see the
bytes in file order. `ordered_map` computes segments on worker threads (numpy, torch and hashlib release
the GIL for the work itself) and hands the results back in order, at most a window ahead, so memory stays
a few segments deep. The GGUF writer builds and encodes its next tensors with it too
(`gguf_writer.encoded_ahead`), its window counted in values (`cost`, `budget`) since its tensors' sizes
differ by thousands of times.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sized
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_WORKERS = 4  # beyond this the digests taken in order, on the calling thread, are the limit


def worker_count() -> int:
    """The cores this process may run on (its affinity mask, as a container or `taskset` sets it), at most MAX_WORKERS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


def ordered_map(compute: Callable[[T], R], items: Iterable[T], workers: int | None = None,
                ahead: int = 2, cost: Callable[[T], int] | None = None, budget: int = 0) -> Iterator[R]:
    """`map(compute, items)`, computed on `workers` threads, `ahead` items per worker at most in flight.

    With `cost`, the window is `budget` of cost instead (items in flight, computed or not, whose costs sum
    to less than `budget`, plus the one that reaches it): items of very different sizes, each small one
    counted as one item, would leave workers idle behind a large one; counted by cost, the window holds
    as much work (and memory) as `budget` says whatever the mix.

    An exception is raised where its item's result would have been yielded (the earlier results are
    yielded first, so the error reported is the first in order, as a sequential loop reports it). When
    the caller stops early (an error, or closing the generator), the items not started are dropped
    and the running ones finish before this returns: no worker still writes into the caller's buffers.
    """
    workers = worker_count() if workers is None else workers
    if workers <= 1 or (isinstance(items, Sized) and len(items) <= 1):  # no thread to start for one item
        yield from map(compute, items)
        return
    pending: deque[tuple[Future[R], int]] = deque()
    in_flight = 0

    def full() -> bool:
        return in_flight >= budget if cost is not None else len(pending) >= workers * ahead

    source = iter(items)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="segments") as pool:
        try:
            for item in source:
                weight = cost(item) if cost is not None else 1
                pending.append((pool.submit(compute, item), weight))
                in_flight += weight
                while pending and full():
                    future, weight = pending.popleft()
                    in_flight -= weight
                    yield future.result()
            while pending:
                yield pending.popleft()[0].result()
        finally:
            for future, _ in pending:
                future.cancel()
