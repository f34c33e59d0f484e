"""Reading a shard back while it is being written: each streamed tensor against its rank shards."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import torch

from mergeflow.errors import CheckpointError
from mergeflow.export.reconstruct.rebuild import (
    PieceSource,
    all_finite,
    primary_chunks,
    same_bytes,
)
from mergeflow.formats.safetensors_format import HeaderEntry
from mergeflow.records import TensorWrite

BLOCK = 16 * 1024 * 1024
RETAINED_BYTES = 64 * 1024 * 1024  # per writer; the read-back only needs to trail the writer a little
_DONE = None


class FollowingReadBack:
    """A thread that re-reads each streamed tensor from the file as soon as the writer has written it.

    The comparison reads the written bytes back through the file (from the page cache, as a
    read after the whole file was written would) and compares them with every rank's local
    shard; the shards' finiteness is checked on the same pass, so rank bytes are scanned once.
    Following the writer instead of running after it puts this work on the core the writer
    leaves idle while its sha256 thread sets the pace.
    """

    def __init__(self, path: Path, data_start: int, entries: dict[str, HeaderEntry], states: PieceSource) -> None:
        self.path = path
        self.data_start = data_start
        self.entries = entries
        self.states = states
        self.checked = 0
        self._queue: queue.Queue[tuple[TensorWrite, list[torch.Tensor] | None, int | None] | None] = queue.Queue()
        # Cast pieces stay alive until compared: at most RETAINED_BYTES of them (or one tensor) wait.
        self._retained = 0
        self._room = threading.Condition()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._handle = open(path, "rb", buffering=0)
        self._thread = threading.Thread(target=self._run, name="read-back", daemon=True)
        self._thread.start()

    def submit(self, tw: TensorWrite, written: list[torch.Tensor] | None = None, begin: int | None = None) -> None:
        """Queue a tensor whose bytes are fully written; raises early if an earlier one failed.

        `written`: the pieces a cast produced (each a rank shard cast on its own, in rank order),
        compared with the file instead of the rank shards; their finiteness was checked at the cast.
        `begin`: where its bytes start in the data section, when it is a part of a file tensor (a
        fused tensor's row block); else its own header entry says.
        """
        if self._error is not None:
            raise self._error
        nbytes = _nbytes(written)
        with self._room:
            while self._retained and self._retained + nbytes > RETAINED_BYTES:
                if self._error is not None or not self._thread.is_alive():
                    raise self._error or CheckpointError(f"{self.path.name}: the read-back stopped")
                self._room.wait(timeout=0.5)
            self._retained += nbytes
        self._queue.put((tw, written, begin))

    def finish(self) -> int:
        """Wait until every queued tensor is compared; returns how many were, raises the first failure."""
        self._close()
        if self._error is not None:
            raise self._error
        return self.checked

    def abort(self) -> None:
        """Stop without waiting for the rest (the write failed; its own error is what counts)."""
        self._stop.set()
        self._close()

    def _close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_DONE)
            self._thread.join()
        self._handle.close()

    def _run(self) -> None:
        buffer = bytearray(BLOCK)
        try:
            while (item := self._queue.get()) is not _DONE and not self._stop.is_set():
                tw, written, begin = item
                offset = self.data_start + (self.entries[tw.name].begin if begin is None else begin)
                if written is None:
                    compare_tensor(self._handle, buffer, offset, tw, self.states, self.path.name)
                else:
                    compare_pieces(self._handle, buffer, offset, tw, written, self.path.name)
                    with self._room:
                        self._retained -= _nbytes(written)
                        self._room.notify_all()
                self.checked += 1
        except BaseException as exc:  # handed to the writer's thread by submit()/finish()
            self._error = exc


def _nbytes(pieces: list[torch.Tensor] | None) -> int:
    return sum(p.numel() * p.element_size() for p in pieces) if pieces else 0


def compare_tensor(handle: Any, buffer: bytearray, offset: int, tw: TensorWrite, states: PieceSource, file_name: str) -> None:
    """Compare a streamed tensor's file region with its rank shards in order, and check them finite."""
    window = torch.frombuffer(buffer, dtype=torch.uint8)
    handle.seek(offset)
    # Each chunk is read from its first rank: messages name that rank (not a position among chunks).
    ranks = [chunk_ranks[0] for chunk_ranks in tw.layout.chunk_ranks]
    # Bytes only (memcmp, numpy's finiteness scan): the pieces are read in place, at any alignment.
    pieces = primary_chunks(tw.layout, states, in_place=True)
    for rank, local in ((r, c) for r, c in zip(ranks, pieces, strict=True) if c.numel()):
        flat = local.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), BLOCK):
            n = min(BLOCK, flat.numel() - start)
            read_exact(handle, memoryview(buffer)[:n], file_name)
            expected = flat[start : start + n]
            if not same_bytes(window[:n], expected):
                raise CheckpointError(f"{tw.name}: round trip failed, the piece from rank {rank} differs from the written bytes")
            if local.is_floating_point() and not all_finite(expected.view(local.dtype)):
                raise CheckpointError(f"{tw.name} (rank {rank}) holds inf or nan values; refusing to export a broken weight")


def compare_pieces(handle: Any, buffer: bytearray, offset: int, tw: TensorWrite, pieces: list[torch.Tensor],
                   file_name: str) -> None:
    """Compare a cast tensor's file region, piece by piece (one per rank shard), with the cast pieces."""
    window = torch.frombuffer(buffer, dtype=torch.uint8)
    handle.seek(offset)
    for index, piece in enumerate(p for p in pieces if p.numel()):
        flat = piece.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), BLOCK):
            n = min(BLOCK, flat.numel() - start)
            read_exact(handle, memoryview(buffer)[:n], file_name)
            if not same_bytes(window[:n], flat[start : start + n]):
                raise CheckpointError(f"{tw.name}: round trip failed, cast piece {index} differs from the written bytes")


def read_exact(handle: Any, view: memoryview, name: str) -> None:
    while len(view):
        n = handle.readinto(view)
        if not n:
            raise CheckpointError(f"{name} is shorter than its header says")
        view = view[n:]
