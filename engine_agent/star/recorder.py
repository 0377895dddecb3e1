"""The agent's hidden-state recorder (`--record-hidden-states DIR`): tap samples in, labelled shards out.

Owns: `HiddenStateRecorder`, which keeps each running request's tap samples in memory (float16 or float32),
labels them when the service reports the request's end (`on_stream_end`: y = final output tokens - generated
tokens at the sample), drops the samples of a request that did not complete here (aborted, cancelled,
failed, migrated away), hands a shard to an executor every `shard_requests` completed requests, and writes
the rest on `aclose`. Memory is bounded by `max_buffered_rows` (samples held open, waiting to be written or
being written): a sample arriving at the bound is dropped and counted, the request's other samples keep their
labels. `RecorderStats` counts what happened.
Must not: block the event loop (files are written in the default executor), subscribe to the tap itself or own
a task (the server owns the task that runs `run`), or decide the file format (that is
`engine_agent.star.shards`).

Samples can reach the recorder after their request's end (a tap batch is built off the loop and published once
its step is delivered): the ids of recently ended requests are remembered (`_ENDED_KEPT`) and their late
samples ignored, so a late sample never opens a request that no end will close. (A request that migrates away
and later comes back under the same id is therefore not recorded on its return.)
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from engine_agent.domain import HiddenStateBatch, RequestId
from engine_agent.service import StreamEnd
from engine_agent.star.shards import ShardRows, ShardWriter

log = logging.getLogger(__name__)

DEFAULT_SHARD_REQUESTS = 128
DEFAULT_MAX_BUFFERED_ROWS = 65_536  # 512 MiB of float16 at hidden size 4096
_ENDED_KEPT = 16_384


@dataclass(frozen=True, slots=True)
class RecorderStats:
    requests_written: int
    rows_written: int
    shards_written: int
    requests_dropped: int  # ended without completing here (aborted, failed, migrated away)
    samples_dropped: int  # over the memory bound, of the wrong width, or taken after the last token
    write_errors: int


class _Open:
    __slots__ = ("generated", "vectors")

    def __init__(self) -> None:
        self.generated: list[int] = []
        self.vectors: list[npt.NDArray[np.generic]] = []


class HiddenStateRecorder:
    """One per agent; `observe` / `on_stream_end` are called on the event loop, `aclose` once at shutdown."""

    def __init__(
        self,
        writer: ShardWriter,
        *,
        shard_requests: int = DEFAULT_SHARD_REQUESTS,
        max_buffered_rows: int = DEFAULT_MAX_BUFFERED_ROWS,
        dtype: type[np.float16] | type[np.float32] = np.float16,
    ) -> None:
        if shard_requests < 1 or max_buffered_rows < 2:
            raise ValueError("shard_requests must be >= 1 and max_buffered_rows >= 2")
        self._writer = writer
        self._hidden_size = writer.hidden_size
        self._shard_requests = shard_requests
        self._max_rows = max_buffered_rows
        self._dtype = np.dtype(dtype)
        self._open: dict[RequestId, _Open] = {}
        self._ended: OrderedDict[RequestId, None] = OrderedDict()
        self._pending: list[ShardRows] = []
        self._pending_rows = 0
        self._open_rows = 0
        self._writing_rows = 0
        self._writes: set[asyncio.Future[Path]] = set()
        self._requests_written = self._rows_written = self._shards_written = 0
        self._requests_dropped = self._samples_dropped = self._write_errors = 0
        self._warned_full = False

    @property
    def stats(self) -> RecorderStats:
        return RecorderStats(
            requests_written=self._requests_written,
            rows_written=self._rows_written,
            shards_written=self._shards_written,
            requests_dropped=self._requests_dropped,
            samples_dropped=self._samples_dropped,
            write_errors=self._write_errors,
        )

    @property
    def buffered_rows(self) -> int:
        """Rows in memory: open requests', completed ones' waiting for a shard, and shards being written."""
        return self._open_rows + self._pending_rows + self._writing_rows

    async def run(self, batches: AsyncIterator[HiddenStateBatch]) -> None:
        """Record every batch of one tap subscription until it ends (or the task is cancelled)."""
        async for batch in batches:
            self.observe(batch)

    def observe(self, batch: HiddenStateBatch) -> None:
        for sample in batch.samples:
            rid = sample.request_id
            if rid in self._ended:
                continue
            vector = sample.vector
            if vector.shape != (self._hidden_size,) or self.buffered_rows >= self._max_rows:
                self._samples_dropped += 1
                if vector.shape == (self._hidden_size,) and not self._warned_full:
                    self._warned_full = True
                    log.warning("hidden-state recorder: %d rows buffered (the bound); dropping samples until "
                                "shards are written", self.buffered_rows)
                continue
            entry = self._open.get(rid)
            if entry is None:
                entry = self._open[rid] = _Open()
            entry.generated.append(sample.generated_tokens)
            entry.vectors.append(vector.astype(self._dtype))
            self._open_rows += 1

    def on_stream_end(self, end: StreamEnd) -> None:
        """The service's hook: label a completed request's samples, drop a request that did not complete."""
        rid = end.request_id
        self._ended[rid] = None
        self._ended.move_to_end(rid)
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)
        entry = self._open.pop(rid, None)
        if end.output_tokens is None:
            self._requests_dropped += 1
            if entry is not None:
                self._open_rows -= len(entry.generated)
            return
        if entry is None:
            return  # completed before any tap saw it decoding
        self._open_rows -= len(entry.generated)
        generated = np.asarray(entry.generated, dtype=np.int32)
        keep = generated <= end.output_tokens
        self._samples_dropped += int(keep.size - keep.sum())
        if not keep.any():
            return
        n = int(keep.sum())
        rows = ShardRows(
            vectors=np.stack(entry.vectors)[keep],
            request_ids=np.full(n, str(rid)),  # dtype <U{len}: np.str_ alone would keep one character
            generated_tokens=generated[keep],
            prompt_tokens=np.full(n, end.prompt_tokens, dtype=np.int32),
            output_tokens=np.full(n, end.output_tokens, dtype=np.int32),
            remaining_tokens=(end.output_tokens - generated[keep]).astype(np.int32),
        )
        self._pending.append(rows)
        self._pending_rows += n
        if len(self._pending) >= self._shard_requests or self._pending_rows >= self._max_rows // 2:
            self._write_pending()

    def _write_pending(self) -> None:
        """Hand the completed requests' rows to the executor as one shard (on the loop)."""
        if not self._pending:
            return
        parts, self._pending = self._pending, []
        rows = ShardRows.concatenate(parts)
        n = len(rows)
        self._pending_rows -= n
        self._writing_rows += n
        path = self._writer.next_path()
        future = asyncio.get_running_loop().run_in_executor(None, self._writer.write, path, rows)
        self._writes.add(future)

        def done(f: asyncio.Future[Path]) -> None:
            self._writing_rows -= n
            self._writes.discard(f)
            error = None if f.cancelled() else f.exception()
            if f.cancelled() or error is not None:
                self._write_errors += 1
                log.error("hidden-state recorder: writing %s failed: %r", path, error)
                return
            self._shards_written += 1
            self._rows_written += n
            self._requests_written += len(parts)

        future.add_done_callback(done)

    async def aclose(self) -> RecorderStats:
        """Write the completed requests not yet written, wait for every write, forget open requests."""
        self._write_pending()
        if self._writes:
            await asyncio.wait(set(self._writes))
        self._open.clear()
        self._open_rows = 0
        stats = self.stats
        log.info(
            "hidden-state recorder: %d request(s), %d row(s) in %d shard(s) under %s; %d request(s) and %d "
            "sample(s) dropped; %d write error(s)",
            stats.requests_written, stats.rows_written, stats.shards_written, self._writer.directory,
            stats.requests_dropped, stats.samples_dropped, stats.write_errors,
        )
        return stats

