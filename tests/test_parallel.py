"""mergeflow.parallel.ordered_map: results in order, the first error in order, no worker left running."""

from __future__ import annotations

import threading
import time

import pytest

from mergeflow.parallel import ordered_map, worker_count


def test_results_come_back_in_order_whatever_order_they_finish_in() -> None:
    def slow_first(i: int) -> int:
        time.sleep(0.02 if i % 3 == 0 else 0.0)  # earlier items finish later
        return i * i

    assert list(ordered_map(slow_first, range(40), workers=3)) == [i * i for i in range(40)]


def test_work_runs_on_several_threads_at_most_a_window_ahead() -> None:
    names: set[str] = set()
    running, most = [0], [0]
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            names.add(threading.current_thread().name)
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return i

    taken = []
    for value in ordered_map(work, range(30), workers=2, ahead=2):
        taken.append(value)
    assert taken == list(range(30))
    assert len(names) == 2 and all(n.startswith("segments") for n in names)
    assert most[0] <= 2


def test_a_cost_window_keeps_every_worker_on_large_items_between_small_ones() -> None:
    # A GGUF file alternates a large weight with its small bias: counted as items, a window of two holds
    # one weight and one bias and leaves a worker idle; counted by cost, two weights run at once.
    sizes = [10 if i % 2 == 0 else 1 for i in range(16)]
    running, most, started = [0], [0], [0]
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            started[0] += sizes[i] == 10
            running[0] += sizes[i] == 10
            most[0] = max(most[0], running[0])
        time.sleep(0.03 if sizes[i] == 10 else 0.0)
        with lock:
            running[0] -= sizes[i] == 10
        return i

    taken, ahead_of_taker = [], []
    for value in ordered_map(work, range(16), workers=2, cost=sizes.__getitem__, budget=20):
        taken.append(value)
        with lock:
            ahead_of_taker.append(started[0] - sum(sizes[i] == 10 for i in taken))
    assert taken == list(range(16))
    assert most[0] == 2
    assert max(ahead_of_taker) <= 2  # the budget: two large items beyond the one taken, whatever the mix
    running[0] = most[0] = 0
    counted = list(ordered_map(work, range(16), workers=2, ahead=1))  # counted as items: one large at a time
    assert counted == list(range(16)) and most[0] == 1


def test_the_first_error_in_order_is_raised_after_the_results_before_it() -> None:
    def work(i: int) -> int:
        if i in (7, 3):
            time.sleep(0.03 if i == 3 else 0.0)  # item 7 fails first in time
            raise ValueError(f"item {i}")
        return i

    got = []
    with pytest.raises(ValueError, match="item 3"):
        for value in ordered_map(work, range(12), workers=2):
            got.append(value)
    assert got == [0, 1, 2]


def test_stopping_early_waits_for_running_work_and_drops_the_rest() -> None:
    started: list[int] = []
    finished: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            started.append(i)
        time.sleep(0.02)
        with lock:
            finished.append(i)
        return i

    results = ordered_map(work, range(100), workers=2, ahead=2)
    assert next(results) == 0
    results.close()  # the caller stops: its buffers must not be written after this returns
    assert sorted(started) == sorted(finished)  # nothing still running
    assert len(started) < 10  # the rest were never started


def test_one_worker_or_one_item_runs_on_the_calling_thread() -> None:
    here = threading.current_thread().name
    assert list(ordered_map(lambda i: threading.current_thread().name, range(3), workers=1)) == [here] * 3
    assert list(ordered_map(lambda i: threading.current_thread().name, range(1), workers=4)) == [here]
    assert list(ordered_map(lambda i: i, range(0), workers=4)) == []


def test_the_worker_count_follows_the_affinity_mask() -> None:
    import os

    assert 1 <= worker_count() <= min(4, len(os.sched_getaffinity(0)))
