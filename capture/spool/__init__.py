"""The local spool: an append-only log on disk that holds every envelope until Kafka *and* S3 have it.

Layout of ``directory``::

    LOCK                         flock'ed while a process has the spool open (one owner at a time)
    00000000000000000001.seg     segment, named by the seq of its first record; rolled at `segment_bytes`
    00000000000000004097.seg     ... the last segment is the only one ever written to
    acks.log                     append-only log of acknowledged seq ranges

The directory is made 0700 and every file in it 0600 when the spool opens, whatever the umask: envelopes
hold prompts and answers in plain text.

Segment: ``b"RLSPOOL" + u8 version`` then records ``u32 length | u32 crc | u64 seq | payload`` (little endian),
``payload`` = ``envelope.canonical()``, ``crc`` = CRC32 (zlib) over the seq bytes and the payload.
Ack log: the same 8-byte header (``b"RLACKS"`` + version) then ``u64 first | u64 last | u32 crc`` records.

Invariants (what makes it correct):

1. `append` returns only after the record's bytes *and* their file's growth are fsynced. Records of concurrent
   appends are written by one writer task in one `write` + one `fsync` (group commit); the HTTP response is
   released after that, so an envelope a client was answered for is on disk. Which appends share a write: by
   default those that arrive while the loop keeps adding to the queue (at most ``group_commit_ms``), so a lone
   appender does not wait; with ``linger_ms`` (best_effort, where no client waits for the spool) every
   ``linger_ms`` after the first, which spares the CPU an fsync per envelope at a steady moderate load
   (BENCHMARKS.md); under a full load both form large batches.
2. Seqs increase by one per record, across segments and restarts. The last segment is never deleted, so its
   name (or its last record) always tells the next seq: an old ack can never match a new record.
3. A record is pending until its seq is in the ack log, and the ack log is fsynced before `ack` returns.
   A segment is deleted only when every record in it is acked and it is not the last one.
4. Opening scans every segment. A record that fails its length or CRC check is:
   - a *torn tail* when it lies in the last segment and no valid record follows it: the bytes were never
     fsynced, hence never acknowledged to a client; they are truncated and one WARNING line says so;
   - *corruption* anywhere else (a sealed segment, or a valid record follows): `SpoolCorruptError` naming the
     file and the offset. Nothing is skipped silently: the operator moves the file aside on purpose.
   The ack log tolerates a torn tail the same way (a lost ack only means a duplicate publish).
5. On open, a fresh segment is started (a file that took a crash is never appended to again) and the ack log
   is rewritten without the ranges of deleted segments (tmp + fsync + rename + fsync of the directory).
6. The bound: `bytes` (pending record bytes, headers included, plus appends in flight) never exceeds
   `max_bytes`; an append that would cross it raises `SpoolFullError` at once. Disk use can exceed it by up to
   one segment of acked records that share a file with pending ones.
7. A write the disk refuses (no space, a short write, a failed fsync) is undone: the active segment is cut back
   to its last complete record (truncate + fsync, retried before the next write if the disk refuses even
   that), the batch's appends are refused (`SpoolFullError` for no space, else `SpoolUnavailableError`),
   ``spool_write_failures_total{reason}`` counts it, and the next append tries again: the spool resumes by
   itself when the disk takes writes again. Only an error that is not the disk's (a bug) stops all appends.

All file IO runs in worker threads (`asyncio.to_thread`); in-memory state is touched only on the event loop.

- `spool`: `Spool`, the API: open and close, `append` (the proxy), `pending` / `wait_pending` / `ack` (the
  publisher).
- `group_commit`: the writer task (invariant 1).
- `segments`: the segments and the index of pending records as the loop sees them; growing and reclaiming.
- `recovery`: opening (invariants 4 and 5) and reading pending records back.
- `accounting`: the bound, its warnings and the spool's gauges (invariant 6).
- `disk_format`: the bytes of segment files and of the ack log.

May import `capture.errors` and, for types, `capture.metrics` and `schemas`; nothing else of the sidecar's.
"""

from capture.spool.disk_format import SEGMENT_SUFFIX
from capture.spool.recovery import SpoolEntry
from capture.spool.segments import DEFAULT_SEGMENT_BYTES
from capture.spool.spool import Spool

__all__ = ["DEFAULT_SEGMENT_BYTES", "SEGMENT_SUFFIX", "Spool", "SpoolEntry"]
