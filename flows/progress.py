"""What the command line shows on stderr while flows run: each flow run's UI link, a progress line."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from mergeflow.export.progress import WRITE_PROGRESS


class StderrProgress:
    """Counts what the shard writers report and redraws one line at most every 0.2 s."""

    def __init__(self, stream=sys.stderr) -> None:  # type: ignore[no-untyped-def]
        self.stream = stream
        self.bytes = 0
        self.tensors = 0
        self._lock = threading.Lock()
        self._last = 0.0
        self._start = time.monotonic()

    def __call__(self, nbytes: int, ntensors: int) -> None:
        with self._lock:
            self.bytes += nbytes
            self.tensors += ntensors
            now = time.monotonic()
            if now - self._last >= 0.2:
                self._last = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.bytes / max(now - self._start, 1e-6) / 1e6
        self.stream.write(f"\rmergeflow: {self.tensors} tensors, {self.bytes / 1e6:.1f} MB written ({rate:.0f} MB/s)")
        self.stream.flush()

    def finish(self) -> None:
        if self.tensors:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


@contextmanager
def stderr_progress() -> Iterator[StderrProgress]:
    bar = StderrProgress()
    try:
        with WRITE_PROGRESS.listening(bar):
            yield bar
    finally:
        bar.finish()


class FlowRunLinks(logging.Handler):
    """Prints `mergeflow: flow run NAME: URL` once per flow run, at the run's first log record.

    Prefect's engine logs "Beginning flow run" on the flow-run logger as soon as the run
    exists on the server; the CLI silences Prefect's console handler, so the link is printed
    here instead. Nothing is printed when the API has no UI (Prefect's temporary server).
    """

    def __init__(self, stream=sys.stderr) -> None:  # type: ignore[no-untyped-def]
        super().__init__(level=logging.DEBUG)
        self.stream = stream
        self.seen: set[str] = set()
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        run_id = getattr(record, "flow_run_id", None)
        if run_id is None:
            return
        with self._lock:
            if str(run_id) in self.seen:
                return
            self.seen.add(str(run_id))
        from prefect.utilities.urls import url_for

        url = url_for("flow-run", obj_id=str(run_id))
        if url:
            name = getattr(record, "flow_run_name", None) or run_id
            self.stream.write(f"mergeflow: flow run {name}: {url}\n")
            self.stream.flush()


@contextmanager
def flow_run_links() -> Iterator[FlowRunLinks]:
    """Show the UI link of every flow run started in this process while the block runs."""
    import prefect.main  # noqa: F401  (configures Prefect's logging, which drops a handler added before it)

    handler = FlowRunLinks()
    logger = logging.getLogger("prefect.flow_runs")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
