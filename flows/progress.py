"""Progress of a merge, for people: the flow's side (phases, bytes, the UI's progress artifact) and stderr.

- The merge flow feeds `merge_progress()`, the `RunProgress` of its flow run: phase changes, the
  ranks loaded, the shards written. The bytes inside a shard come from the shard writers'
  reports to their export's session, routed by `route_write` to the run whose task wrote them
  (several merges may run in one process). The run's Prefect progress artifact follows the bytes written of the output's total.
- The command line shows it with `stderr_progress()`: a rich progress bar on a terminal, one plain
  line per phase otherwise (a pipe, a CI log), every line starting with `mergeflow: `.
- `flow_run_links()` prints each flow run's UI link as the run starts: the first line a user sees.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO, Any
from uuid import UUID

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskID, TextColumn
from rich.text import Text

from mergeflow.export.progress import (
    HASHING,
    INSPECTING,
    LOADING,
    MERGE_PROGRESS,
    PUBLISHING,
    SMOKING,
    UPLOADING,
    VALIDATING,
    WRITING,
    MergeProgress,
    Reuse,
    Snapshot,
    human_bytes,
    human_duration,
    human_rate,
)
from mergeflow.records import CopyResult, OutputPlan, ShardRecord

# --- the flow's side -----------------------------------------------------------------------------

ARTIFACT_EVERY_S = 2.0  # the UI's progress artifact is updated at most this often while bytes move (and per shard)

_RUNS: weakref.WeakValueDictionary[UUID, RunProgress] = weakref.WeakValueDictionary()
_CURRENT: ContextVar[RunProgress | None] = ContextVar("mergeflow_run_progress", default=None)


class RunProgress:
    """The progress of one merge flow run (see `merge_progress`)."""

    def __init__(self, run_id: UUID | None, tracker: MergeProgress) -> None:
        self.run_id = run_id
        self.tracker = tracker
        self.reused_shards = 0  # write-shard tasks that found an earlier run's shard intact (Cached)

    def begin(self, phase: str, total: int | None = None) -> None:
        self.tracker.begin(phase, total)

    def counting(self, phase: str, futures: Sequence[Any]) -> None:
        """Begin `phase`, one step per future as it completes (loading ranks 3/8); never waits."""
        self.tracker.begin(phase, total=len(futures))
        for future in futures:
            future.add_done_callback(lambda _future: self.tracker.step(phase=phase))

    def begin_writing(self, output: OutputPlan) -> None:
        """The writing phase: the packed output's bytes, shard by shard (call before submitting the writers)."""
        self.tracker.begin_writing([s.nbytes for s in output.shards], output.tensor_count)

    def written_shards(self, futures: Sequence[Any], artifact: UUID | None) -> Iterator[ShardRecord]:
        """Each shard's record as its write completes (any order; `futures` in shard order).

        The progress artifact `artifact` follows the bytes written: at every shard and every
        ARTIFACT_EVERY_S while bytes move, and, when a write fails or the run is stopped, it ends
        at the bytes written so far instead of where the last finished shard left it.
        """
        from mergeflow.flows.artifacts import report_progress

        finished: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for future in futures:
            future.add_done_callback(finished.put)
        shard_of = {id(f): i for i, f in enumerate(futures)}
        total = self.tracker.bytes_total
        reported = -1
        pending = len(futures)
        try:
            while pending:
                try:
                    future = finished.get(timeout=ARTIFACT_EVERY_S)
                except queue.Empty:
                    future = None
                if future is not None:
                    pending -= 1
                    record = future.result()
                    resumed = _resumed(future)
                    self.reused_shards += resumed
                    self.tracker.shard_done(shard_of[id(future)], resumed=resumed)
                done = self.tracker.bytes_done
                if done != reported:
                    report_progress(artifact, done, total)
                    reported = done
                if future is not None:
                    yield record
        except BaseException:
            try:
                report_progress(artifact, self.tracker.bytes_done, total, stopped=True)
            except Exception:  # the write's own error is the one to report
                logging.getLogger(__name__).debug("could not update the progress artifact", exc_info=True)
            raise

    def wrote(self, shard: int, nbytes: int, attempt: int) -> None:
        self.tracker.wrote(shard, nbytes, attempt)

    def report_reuse(self, shards: int, copied: CopyResult | None) -> Reuse | None:
        """After the shards and copies: how much a rerun reused of the staging an earlier run kept.

        Said in the run's log (the UI) and on the command line's stderr; nothing when nothing was reused.
        """
        from prefect.logging import get_run_logger

        reuse = Reuse(self.reused_shards, shards, len(copied.reused) if copied else 0, len(copied.files) if copied else 0)
        if not reuse.shards and not reuse.files:
            return None
        get_run_logger().info("Resumed the staging an earlier run kept: %s", reuse.words())
        self.tracker.reused(reuse)
        return reuse


def merge_progress() -> RunProgress:
    """The progress of the merge flow run this is called in; created (and shown) at the run's first call."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    run_id = context.flow_run.id if context is not None and context.flow_run is not None else None
    current = _CURRENT.get()
    if current is not None and run_id is not None and current.run_id == run_id:
        return current
    current = RunProgress(run_id, MERGE_PROGRESS.start())
    _CURRENT.set(current)
    if run_id is not None:
        _RUNS[run_id] = current
    return current


def route_write(nbytes: int, ntensors: int) -> None:
    """A shard writer's report, to the run whose write-shard task made it (called in the writer's thread)."""
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    if context is None:
        return
    run = _RUNS.get(context.task_run.flow_run_id) if context.task_run.flow_run_id is not None else None
    shard = getattr(context.parameters.get("shard"), "index", None)
    if run is not None and isinstance(shard, int):
        run.wrote(shard, nbytes, context.task_run.run_count)



def _resumed(future: Any) -> bool:
    """A shard whose task found an earlier run's write intact (Prefect's Cached state)."""
    try:
        return future.state.name == "Cached"
    except Exception:  # noqa: BLE001 - only a finer rate hangs on it
        return False


# --- stderr --------------------------------------------------------------------------------------

PREFIX = "mergeflow: "
_PAST = {INSPECTING: "inspected the checkpoint", LOADING: "loaded", HASHING: "hashed", SMOKING: "ran one step", VALIDATING: "validated",
         PUBLISHING: "published", UPLOADING: "uploaded"}
_BAR_LABEL = {INSPECTING: "inspecting", LOADING: "loading ranks", WRITING: "writing", HASHING: "hashing rank files",
              SMOKING: "running one step", VALIDATING: "validating", PUBLISHING: "publishing", UPLOADING: "uploading"}


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" if n == 1 else f"{n} {thing}s"


def phase_line(snap: Snapshot) -> str:
    """The line a phase begins with."""
    if snap.phase == INSPECTING:
        return f"{PREFIX}inspecting the checkpoint"
    if snap.phase == LOADING and snap.total is not None:
        return f"{PREFIX}loading {_count(snap.total, 'rank file')}"
    if snap.phase == WRITING and snap.total is not None:
        return f"{PREFIX}writing {human_bytes(snap.total)} in {_count(snap.shards, 'shard')} ({_count(snap.tensors, 'tensor')})"
    if snap.phase == HASHING and snap.total is not None:
        return f"{PREFIX}hashing {_count(snap.total, 'rank file')}"
    return f"{PREFIX}{snap.phase}"


def wrote_line(snap: Snapshot) -> str:
    """The writing phase at its end: bytes, time and the average rate of what this run wrote itself."""
    streamed = max(snap.done - snap.resumed, 0)
    line = f"{PREFIX}wrote {human_bytes(streamed)} in {human_duration(snap.elapsed)} ({human_rate(snap.average_rate)})"
    if snap.resumed:
        line += f", resumed {human_bytes(snap.resumed)} an earlier run had written"
    return line


def ended_line(snap: Snapshot) -> str:
    """A finished phase, as a terminal keeps it above the bar."""
    if snap.phase == WRITING:
        return wrote_line(snap)
    what = _PAST.get(snap.phase or "", snap.phase or "")
    if snap.phase in (LOADING, HASHING) and snap.total is not None:
        what += f" {_count(snap.total, 'rank file')}"
    return f"{PREFIX}{what} in {human_duration(snap.elapsed)}"


def stopped_line(snap: Snapshot) -> str | None:
    """What a failed or interrupted merge had got to, where bytes tell it (the error line follows)."""
    if snap.phase != WRITING or snap.total is None:
        return None
    percent = 100.0 * (snap.fraction or 0.0)
    return f"{PREFIX}stopped while writing: {human_bytes(snap.done)} of {human_bytes(snap.total)} written ({percent:.0f}%)"


def figures(snap: Snapshot) -> str:
    """The bar's numbers: bytes done of total, percent, recent rate, ETA; k/N; or the time in the phase.

    The ETA is left out (blank) until the model has one worth showing (Snapshot.eta).
    """
    if snap.phase == WRITING and snap.total is not None:
        percent = 100.0 * (snap.fraction or 0.0)
        eta = f"  ETA {human_duration(snap.eta)}" if snap.eta is not None else ""
        return f"{human_bytes(snap.done)} of {human_bytes(snap.total)}  {percent:3.0f}%  {human_rate(snap.rate)}{eta}"
    if snap.total is not None:
        return f"{snap.done}/{snap.total}"
    return human_duration(snap.elapsed)


class _Figures(ProgressColumn):
    """Read again at every redraw, so the rate falls and the ETA grows while a write stalls."""

    def __init__(self, display: StderrProgress) -> None:
        super().__init__()
        self.display = display

    def render(self, task: Task) -> Text:
        snap = self.display.latest()
        return Text(figures(snap) if snap is not None else "")


class StderrProgress:
    """A merge's progress on `stream`: a rich progress bar on a terminal, else one plain line per phase.

    An observer of MERGE_PROGRESS (see `stderr_progress`). On a terminal, each finished phase
    stays as one line above the bar; in a pipe nothing is ever redrawn. `close` ends the display
    with the time the merge took, or, after a failure, the bytes it got to.
    """

    def __init__(self, stream: IO[str] | None = None, console: Console | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.console = console if console is not None else Console(file=self.stream, highlight=False)
        self.live = self.console.is_terminal and not self.console.is_dumb_terminal
        self.clock = clock
        self._lock = threading.RLock()
        self._source: MergeProgress | None = None
        self._current: Snapshot | None = None
        self._started: float | None = None
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._closed = False

    # --- Observer --------------------------------------------------------------------------------

    def phase_began(self, progress: MergeProgress, now: Snapshot, previous: Snapshot | None) -> None:
        with self._lock:
            if self._closed:
                return
            if self._started is None:
                self._started = self.clock()
            if self._source is not progress:  # a merge of its own (one per command): earlier phases are not its
                self._source, previous = progress, None
            self._current = now
            if self.live:
                if previous is not None:
                    self._print(ended_line(previous))
                self._show(now)
            else:
                if previous is not None and previous.phase == WRITING:
                    self._write(wrote_line(previous))
                self._write(phase_line(now))

    def advanced(self, progress: MergeProgress, now: Snapshot) -> None:
        with self._lock:
            if self._closed or progress is not self._source or self._current is None:
                return
            if now.phase != self._current.phase or now.done < self._current.done:
                return  # an older report, from a thread that was late to tell
            self._current = now
            if self._bar is not None and self._task is not None:
                self._bar.update(self._task, completed=now.done)

    def reused(self, progress: MergeProgress, reuse: Reuse) -> None:
        with self._lock:
            if self._closed or progress is not self._source:
                return
            line = f"{PREFIX}resumed the staging an earlier run kept: {reuse.words()}"
            if self.live and self._bar is not None:
                self._print(line)  # above the bar
            else:
                self._write(line)

    # --- the command's side ----------------------------------------------------------------------

    def latest(self) -> Snapshot | None:
        """The current phase as it stands now (its rate and ETA computed at this moment)."""
        source = self._source
        return source.snapshot() if source is not None else self._current

    def refresh(self) -> None:
        """Redraw the bar now (it redraws itself 5 times a second and at every phase)."""
        with self._lock:
            if self._bar is not None:
                self._bar.refresh()

    def close(self, failed: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            last = self.latest()
            lines: list[str] = []
            if last is not None and last.phase is not None:
                if failed:
                    stopped = stopped_line(last)
                    lines += [stopped] if stopped else []
                else:
                    if self.live:
                        lines.append(ended_line(last))
                    if last.phase == WRITING and not self.live:
                        lines.append(wrote_line(last))
                    started = self._started if self._started is not None else self.clock()
                    lines.append(f"{PREFIX}done in {human_duration(self.clock() - started)}")
            if self._bar is not None:
                for line in lines:
                    self._print(line)
                self._bar.stop()
                self._bar = None
            else:
                for line in lines:
                    self._write(line)

    # --- drawing ---------------------------------------------------------------------------------

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def _print(self, line: str) -> None:
        self.console.print(Text(line), soft_wrap=True)

    def _show(self, snap: Snapshot) -> None:
        label = _BAR_LABEL.get(snap.phase or "", snap.phase or "")
        if self._bar is None:
            self._bar = Progress(
                TextColumn(PREFIX + "{task.description}"), BarColumn(bar_width=32), _Figures(self),
                console=self.console, transient=True, refresh_per_second=5, redirect_stdout=False,
                # Lines others print to stderr meanwhile (another run's UI link) go above the bar.
                redirect_stderr=self.console.file is sys.stderr,
            )
            self._bar.start()
        if self._task is not None:  # one task per phase: a phase without a measure pulses (total None)
            self._bar.remove_task(self._task)
        self._task = self._bar.add_task(label, total=snap.total, completed=snap.done)


def telemetry_notice_now() -> None:
    """Prefect's first-run telemetry notice, if it is due, now: before a progress display, never inside it.

    Prefect prints it when a process imports it on a terminal, at most once per PREFECT_HOME (a marker
    file there). This process's import skipped it for a home that already had Prefect's files (the
    local server's), but a process importing Prefect later (a Dask worker, with the same terminal)
    finds that home already looked at, takes it for a new one and printed the notice in the middle
    of the progress bar. Shown here it is marked shown, and those processes stay silent.
    """
    try:
        from prefect._internal.analytics import is_telemetry_enabled
        from prefect._internal.analytics.notice import maybe_show_telemetry_notice
    except ImportError:  # a Prefect without it: nothing to print
        return
    try:
        if is_telemetry_enabled():  # DO_NOT_TRACK or a CI: never shown (Prefect's own rule at import)
            maybe_show_telemetry_notice()  # only on a terminal, only once per PREFECT_HOME
    except Exception:  # noqa: BLE001 - a notice must never stop an export
        logging.getLogger(__name__).debug("could not settle Prefect's telemetry notice", exc_info=True)


@contextmanager
def stderr_progress(stream: IO[str] | None = None, console: Console | None = None) -> Iterator[StderrProgress]:
    """Show the progress of the merges run in this process while the block runs."""
    telemetry_notice_now()
    display = StderrProgress(stream, console)
    failed = True
    try:
        with MERGE_PROGRESS.listening(display):
            yield display
        failed = False
    finally:
        display.close(failed=failed)


# --- UI links ------------------------------------------------------------------------------------


class FlowRunLinks(logging.Handler):
    """Prints `mergeflow: flow run NAME: URL` once per flow run, at the run's first log record.

    Prefect's engine logs "Beginning flow run" on the flow-run logger as soon as the run
    exists on the server; the CLI silences Prefect's console handler, so the link is printed
    here instead. Nothing is printed when the API has no UI (Prefect's temporary server).
    """

    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__(level=logging.DEBUG)
        self.stream = stream  # None: sys.stderr as it is at that moment (above a progress bar while one is shown)
        self.seen: set[str] = set()
        self.urls: list[str] = []  # in start order: the demo repeats its run's link at the end
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
            self.urls.append(url)
            name = getattr(record, "flow_run_name", None) or run_id
            stream = self.stream if self.stream is not None else sys.stderr
            stream.write(f"mergeflow: flow run {name}: {url}\n")
            stream.flush()


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
