"""How far a merge is: its phases, the bytes written of the total, the recent rate and the time left.

The shard writers report every tensor they write to their export's session
(`mergeflow.io.session.WriteListeners`); the flow routes those reports into this model.
`MERGE_PROGRESS` is the feed of the merge flow's `MergeProgress` (phase changes, ranks loaded,
bytes written of the packed output's total) for whoever shows it: the command line's stderr
display subscribes. Neither needs Prefect or a display.

`MergeProgress` is the model: which phase, how much of it is done, a rate over the last seconds
and an ETA from that rate. It tells its observer about every change with an immutable `Snapshot`,
outside its own lock (a display may read it back from another thread while drawing).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

# --- phases, rate, ETA ---------------------------------------------------------------------------

INSPECTING = "inspecting"
LOADING = "loading"  # the rank files' indexes; total: the world size
WRITING = "writing"  # the output shards (the rank files are hashed on the cores the writers leave); total: bytes
HASHING = "hashing"  # what is left of hashing the rank files once the shards are written; total: rank files
SMOKING = "runtime check"  # --smoke: one denoising step of the staged artifact (mergeflow/ops/smoke.py)
VALIDATING = "validating"
PUBLISHING = "publishing"
UPLOADING = "uploading"
PHASES = (INSPECTING, LOADING, WRITING, HASHING, SMOKING, VALIDATING, PUBLISHING, UPLOADING)

RATE_WINDOW_S = 5.0
MIN_RATE_SPAN_S = 0.2  # a rate over less than this is noise (the first tensor of a phase)
# No ETA before the phase's count has moved for this long: the first ticks' rate (one small tensor
# after the writers' start-up) once promised `ETA 11:59:19` for a write that took seconds.
ETA_AFTER_S = 2.0


class RateWindow:
    """The rate of a growing count over the last `seconds`.

    Samples are (time, count). The rate at `now` is the growth since the newest sample at least
    `seconds` old (the oldest sample while the phase is younger than that), over the time since
    it: a stall drives it to 0 instead of freezing the last value, a fast start is forgotten
    after `seconds`.
    """

    def __init__(self, seconds: float = RATE_WINDOW_S) -> None:
        self.seconds = seconds
        self._samples: deque[tuple[float, int]] = deque()

    def reset(self, now: float, count: int = 0) -> None:
        self._samples.clear()
        self._samples.append((now, count))

    def add(self, now: float, count: int) -> None:
        self._samples.append((now, count))
        self._prune(now)

    def rate(self, now: float) -> float | None:
        """Units per second, or None before there is a span long enough to tell."""
        if not self._samples:
            return None
        self._prune(now)
        t0, c0 = self._samples[0]
        span = now - t0
        if span < MIN_RATE_SPAN_S:
            return None
        return max(self._samples[-1][1] - c0, 0) / span

    def _prune(self, now: float) -> None:
        # Keep one sample at or before the window's start: the anchor the rate is measured from.
        horizon = now - self.seconds
        while len(self._samples) > 1 and self._samples[1][0] <= horizon:
            self._samples.popleft()


def eta_seconds(done: int, total: int | None, rate: float | None) -> float | None:
    """Seconds left at `rate`; None without a total or while nothing moves."""
    if total is None:
        return None
    if done >= total:
        return 0.0
    if not rate:
        return None
    return (total - done) / rate


@dataclass(frozen=True)
class Snapshot:
    """The state of a merge at one moment, as observers and displays get it."""

    phase: str | None
    done: int  # of the phase: ranks loaded, bytes written (resumed shards included), rank files hashed
    total: int | None  # None: a phase without a measure (inspecting, validating, publishing)
    elapsed: float  # seconds in this phase
    since_start: float  # seconds since the merge began
    rate: float | None = None  # units per second over the last RATE_WINDOW_S, of what this run itself did
    eta: float | None = None  # None (shown blank) until the count has moved for ETA_AFTER_S
    shards: int = 0  # writing: shards of the output
    tensors: int = 0  # writing: tensors of the output
    resumed: int = 0  # writing: bytes of the shards an earlier run had written and this one reused

    @property
    def fraction(self) -> float | None:
        if self.total is None:
            return None
        return 1.0 if self.total <= 0 else min(self.done / self.total, 1.0)

    @property
    def average_rate(self) -> float | None:
        """What this run did over the whole phase, per second (resumed bytes left out)."""
        if self.elapsed <= 0:
            return None
        return max(self.done - self.resumed, 0) / self.elapsed


@dataclass(frozen=True)
class Reuse:
    """What a rerun took over from the staging an earlier run of the same export kept."""

    shards: int  # output shards whose staged file was intact (not written again)
    of_shards: int
    files: int  # base files whose staged copy was right (not copied again)
    of_files: int

    def words(self) -> str:
        """`reused 3 of 4 shards and 7 of 7 files` (no files part where the output copies none)."""
        text = f"reused {self.shards} of {_plural(self.of_shards, 'shard')}"
        return text + (f" and {self.files} of {_plural(self.of_files, 'file')}" if self.of_files else "")


def _plural(n: int, thing: str) -> str:
    return f"{n} {thing}" if n == 1 else f"{n} {thing}s"


class Observer(Protocol):
    """What a display implements; `progress` is the merge the snapshot is of (to read it again while drawing)."""

    def phase_began(self, progress: MergeProgress, now: Snapshot, previous: Snapshot | None) -> None:
        """`previous`: the phase that just ended, as it stood at its end (None for the first phase)."""

    def advanced(self, progress: MergeProgress, now: Snapshot) -> None: ...

    def reused(self, progress: MergeProgress, reuse: Reuse) -> None:
        """A resumed run's count of what it took over from the kept staging (once, after the writing)."""



@dataclass
class _Shard:
    size: int
    written: int = 0
    attempt: int = 0
    done: bool = False
    resumed: bool = False


@dataclass
class _State:
    phase: str | None = None
    phase_started: float = 0.0
    done: int = 0
    total: int | None = None
    shards: list[_Shard] = field(default_factory=list)
    tensors: int = 0


class MergeProgress:
    """One merge's phases and counts; every change goes to `observer` as a `Snapshot`.

    Thread-safe: shard writers report from worker threads while the flow changes phases.
    """

    def __init__(self, observer: Observer | None = None, clock: Callable[[], float] = time.monotonic,
                 window: float = RATE_WINDOW_S) -> None:
        self.observer = observer
        self.clock = clock
        self.started = clock()
        self._state = _State(phase_started=self.started)
        self._rate = RateWindow(window)
        self._moving_since: float | None = None  # when this run's count first grew since the last restart of the rate
        self._lock = threading.Lock()

    # --- the flow's side -------------------------------------------------------------------------

    def begin(self, phase: str, total: int | None = None) -> None:
        """A new phase; the current one ends. `total`: the phase's measure (ranks, rank files), if any."""
        with self._lock:
            previous = self._snapshot_locked(self.clock()) if self._state.phase is not None else None
            self._begin_locked(phase, total)
            now = self._snapshot_locked(self.clock())
        if self.observer is not None:
            self.observer.phase_began(self, now, previous)

    def begin_writing(self, shard_sizes: Sequence[int], tensors: int) -> None:
        """The writing phase: `shard_sizes` (bytes of each output shard, in order) sum to its total."""
        with self._lock:
            previous = self._snapshot_locked(self.clock()) if self._state.phase is not None else None
            self._begin_locked(WRITING, sum(shard_sizes))
            self._state.shards = [_Shard(size) for size in shard_sizes]
            self._state.tensors = tensors
            now = self._snapshot_locked(self.clock())
        if self.observer is not None:
            self.observer.phase_began(self, now, previous)

    def step(self, n: int = 1, phase: str | None = None) -> None:
        """`n` more units of the phase done (a rank file indexed, a rank file hashed).

        With `phase`, only while that phase lasts: a completion callback may run after the flow moved on.
        """
        with self._lock:
            if phase is not None and phase != self._state.phase:
                return
            self._state.done += n
            snap = self._changed_locked()
        self._tell(snap)

    def wrote(self, shard: int, nbytes: int, attempt: int = 1) -> None:
        """`nbytes` more of `shard` written; a new `attempt` (a retried write) starts the shard over."""
        with self._lock:
            s = self._shard_locked(shard)
            if s is None or s.done:
                return
            if attempt != s.attempt:
                s.attempt, s.written = attempt, 0
            s.written = min(s.written + nbytes, s.size)
            snap = self._changed_locked()
        self._tell(snap)

    def shard_done(self, shard: int, resumed: bool = False) -> None:
        """`shard` is written and verified; `resumed`: an earlier run wrote it (its bytes are no rate of ours)."""
        with self._lock:
            s = self._shard_locked(shard)
            if s is None or s.done:
                return
            s.done, s.resumed = True, resumed
            s.written = s.size
            if resumed:  # the jump is not this run's speed: start the window over at the new count
                self._recount_locked()
                self._restart_rate_locked(self.clock(), self._streamed_locked())
                snap = self._snapshot_locked(self.clock())
            else:
                snap = self._changed_locked()
        self._tell(snap)

    def reused(self, reuse: Reuse) -> None:
        """Tell the observer how much of an earlier run's kept staging this run reused."""
        if self.observer is not None:
            self.observer.reused(self, reuse)

    # --- anyone's side ---------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot_locked(self.clock())

    @property
    def bytes_done(self) -> int:
        """Bytes of the output written (resumed shards included); 0 before the writing phase."""
        with self._lock:
            return sum(s.written for s in self._state.shards)

    @property
    def bytes_total(self) -> int:
        with self._lock:
            return sum(s.size for s in self._state.shards)

    # --- inside the lock -------------------------------------------------------------------------

    def _begin_locked(self, phase: str, total: int | None) -> None:
        now = self.clock()
        keep_shards = self._state.shards  # bytes written stay known after the writing phase
        self._state = _State(phase=phase, phase_started=now, total=total, shards=keep_shards,
                             tensors=self._state.tensors)
        self._restart_rate_locked(now, 0)

    def _restart_rate_locked(self, now: float, count: int) -> None:
        """Measure the rate afresh from `count` (a new phase, a resumed shard's jump)."""
        self._rate.reset(now, count)
        self._moving_since = None

    def _shard_locked(self, shard: int) -> _Shard | None:
        shards = self._state.shards
        return shards[shard] if self._state.phase == WRITING and 0 <= shard < len(shards) else None

    def _recount_locked(self) -> None:
        if self._state.phase == WRITING:
            self._state.done = sum(s.written for s in self._state.shards)

    def _streamed_locked(self) -> int:
        """What the rate measures: the phase's count less what an earlier run did."""
        resumed = sum(s.size for s in self._state.shards if s.resumed) if self._state.phase == WRITING else 0
        return self._state.done - resumed

    def _changed_locked(self) -> Snapshot:
        self._recount_locked()
        now = self.clock()
        if self._moving_since is None:
            # The first report: the rate counts from here, not from the phase's start (the time
            # the writers took to begin is no speed of theirs).
            self._moving_since = now
            self._rate.reset(now, self._streamed_locked())
        else:
            self._rate.add(now, self._streamed_locked())
        return self._snapshot_locked(now)

    def _eta_locked(self, now: float, rate: float | None) -> float | None:
        """The ETA once it means something: never before the count has moved for ETA_AFTER_S (0 when done)."""
        st = self._state
        if st.total is not None and st.done >= st.total:
            return 0.0
        if self._moving_since is None or now - self._moving_since < ETA_AFTER_S:
            return None
        return eta_seconds(st.done, st.total, rate)

    def _snapshot_locked(self, now: float) -> Snapshot:
        st = self._state
        writing = st.phase == WRITING
        rate = self._rate.rate(now) if st.total is not None else None
        return Snapshot(
            phase=st.phase, done=st.done, total=st.total, elapsed=now - st.phase_started,
            since_start=now - self.started, rate=rate, eta=self._eta_locked(now, rate),
            shards=len(st.shards) if writing else 0, tensors=st.tensors if writing else 0,
            resumed=sum(s.size for s in st.shards if s.resumed) if writing else 0,
        )

    def _tell(self, snap: Snapshot) -> None:
        if self.observer is not None:
            self.observer.advanced(self, snap)


class ProgressFeed:
    """The observers of this process's merges (the command line's display), for `with` blocks.

    A `MergeProgress` started here tells every observer subscribed at the moment of each change.
    """

    def __init__(self) -> None:
        self._observers: tuple[Observer, ...] = ()
        self._lock = threading.Lock()

    @contextmanager
    def listening(self, observer: Observer) -> Iterator[None]:
        with self._lock:
            self._observers = (*self._observers, observer)
        try:
            yield
        finally:
            with self._lock:
                self._observers = tuple(x for x in self._observers if x is not observer)

    def start(self, clock: Callable[[], float] = time.monotonic, window: float = RATE_WINDOW_S) -> MergeProgress:
        return MergeProgress(self, clock=clock, window=window)

    def phase_began(self, progress: MergeProgress, now: Snapshot, previous: Snapshot | None) -> None:
        for observer in self._observers:
            observer.phase_began(progress, now, previous)

    def advanced(self, progress: MergeProgress, now: Snapshot) -> None:
        for observer in self._observers:
            observer.advanced(progress, now)

    def reused(self, progress: MergeProgress, reuse: Reuse) -> None:
        for observer in self._observers:
            observer.reused(progress, reuse)



MERGE_PROGRESS = ProgressFeed()


# --- words for people ----------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    """Decimal units, as disks and the Hub count: 864.9 MB, 5.3 GB."""
    size, unit = float(n), "B"
    for bigger in ("kB", "MB", "GB", "TB"):
        if size < 1000:
            break
        size, unit = size / 1000, bigger
    return f"{int(n)} B" if unit == "B" else f"{size:.1f} {unit}"


def human_rate(per_second: float | None) -> str:
    return "-" if per_second is None else f"{human_bytes(per_second)}/s"


def human_duration(seconds: float | None) -> str:
    """1.2 s, 42.0 s, 3:07, 1:02:03; "-" when unknown."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"
