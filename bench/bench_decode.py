"""`make bench-decode`: how fast pg2delta decodes a window, next to how fast PostgreSQL emits it.

One run, one throwaway PostgreSQL (15 by default):

1. a mixed 10-column table and one slot + publication; a window of ``--changes`` changes
   (inserts in transactions of ``--txn-rows`` rows, then updates of a subset, same size);
2. **server**: ``COPY (SELECT data FROM pg_logical_slot_peek_binary_changes(...)) TO STDOUT
   (FORMAT binary)`` read by the client and dropped: PostgreSQL's own emission rate;
3. **capture** (not timed against anything): the window read once with the real
   ``SlotSource.read_window`` into RowChunks, plus the raw CopyData blocks it read;
4. **decode**: ``WindowDecoder.feed`` over the captured chunks, then ``finish`` - everything
   from the window's bytes to Arrow record batches;
5. **framing**: the client half of ``read_window`` (the CopyData blocks gathered into a buffer,
   their rows framed in C) replayed over the captured blocks, no server involved.

Each timing is the best of ``--repeat`` runs. An extra instrumented pass splits the decode
by stage (not part of the best-of timings). ``--profile`` adds a cProfile of one decode pass.
The last line is ``decode_vs_server=<our changes/s divided by the server's changes/s>``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import pstats
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from pg2delta.decode import changes as ch
from pg2delta.decode import rowbatch
from pg2delta.decode import typemap as tm
from pg2delta.decode.changes import RowChunk, WindowDecoder
from pg2delta.source import copydata
from pg2delta.source import slot as sl
from pg2delta.source.slot import SlotSource, WindowRead
from pg2delta.source.throwaway import ThrowawayPostgres

TABLE = "public.bench_mixed"
SLOT = "bench_slot"
PUB = "bench_pub"

SETUP = f"""
CREATE TABLE {TABLE} (
    id bigint PRIMARY KEY,
    qty int NOT NULL,
    ref int,
    name text NOT NULL,
    note text,
    amount numeric(12,2),
    at timestamptz NOT NULL,
    doc jsonb,
    flag bool,
    score float8
);
CREATE PUBLICATION {PUB} FOR TABLE {TABLE};
"""

# Values vary in length and include NULLs; texts stay far below the TOAST threshold.
INSERT = f"""
INSERT INTO {TABLE}
SELECT g,
       g %% 1000,
       CASE WHEN g %% 7 = 0 THEN NULL ELSE g %% 100000 END,
       'customer ' || g,
       CASE WHEN g %% 3 = 0 THEN NULL ELSE repeat('x', (g %% 40)::int) || ' note ' || g END,
       ((g %% 100000) * 1.37)::numeric(12,2),
       timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second',
       jsonb_build_object('n', g, 'tag', 't' || (g %% 17), 'ok', g %% 2 = 0),
       g %% 2 = 0,
       g * 0.001
FROM generate_series(%s::bigint, %s::bigint) g
"""

UPDATE = f"""
UPDATE {TABLE}
SET qty = qty + 1, note = 'updated ' || id, amount = amount + 1.01, score = score * 2, flag = NOT flag
WHERE id BETWEEN %s AND %s
"""


@dataclass(frozen=True)
class Window:
    """A prepared window: the server, the slot, the LSN after the workload, what it holds."""

    pg: ThrowawayPostgres
    upto: int
    inserts: int
    updates: int

    @property
    def changes(self) -> int:
        return self.inserts + self.updates


def peek_options() -> list[str]:
    return ["proto_version", "1", "publication_names", PUB, "binary", "true"]


def peek_call(upto: int | None = None) -> sql.Composed:
    from pg2delta.lsn import format_lsn

    return sql.SQL("pg_logical_slot_peek_binary_changes({slot}, {upto}, NULL, {opts})").format(
        slot=sql.Literal(SLOT),
        upto=sql.SQL("NULL") if upto is None else sql.SQL("{}::pg_lsn").format(sql.Literal(format_lsn(upto))),
        opts=sql.SQL(", ").join(sql.Literal(o) for o in peek_options()),
    )


def make_window(version: int, changes: int, *, txn_rows: int = 1000, update_share: float = 0.25) -> Window:
    """Start a server and fill one slot with ``changes`` changes (inserts, then updates)."""
    pg = ThrowawayPostgres.start(version)
    try:
        updates = int(changes * update_share)
        inserts = changes - updates
        t0 = time.perf_counter()
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute(SETUP)
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
            for lo in range(1, inserts + 1, txn_rows):
                conn.execute(INSERT, (lo, min(lo + txn_rows - 1, inserts)))
            for lo in range(1, updates + 1, txn_rows):
                conn.execute(UPDATE, (lo, min(lo + txn_rows - 1, updates)))
            row = conn.execute("SELECT pg_current_wal_flush_lsn()").fetchone()
            assert row is not None
            upto = sl._lsn_value(row[0])
            assert upto is not None
        print(
            f"workload: PostgreSQL {version}, {inserts:,} inserts + {updates:,} updates "
            f"in transactions of {txn_rows} rows ({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        return Window(pg, upto, inserts, updates)
    except BaseException:
        pg.stop()
        raise


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    best = float("inf")
    result = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


# --- the server's side ----------------------------------------------------------------------


def server_copy(dsn: str, upto: int | None = None) -> tuple[int, float]:
    """COPY of the peek into nothing: rows the client received and dropped, seconds to the first one."""
    query = sql.SQL("COPY (SELECT data FROM {peek}) TO STDOUT (FORMAT binary)").format(peek=peek_call(upto))
    pieces = nbytes = 0
    first = last = b""
    first_at = 0.0
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        t0 = time.perf_counter()
        with cur.copy(query) as copy:
            for data in copy:
                if not pieces:
                    first_at = time.perf_counter() - t0
                    first = bytes(data)
                pieces += 1
                nbytes += len(data)
                last = data
    # The 19-byte header may come alone or with the first row; the 2-byte trailer comes alone.
    rows = pieces - (bytes(last) == b"\xff\xff") - (len(first) == copydata._COPY_HEADER_LEN)
    return rows, first_at


def server_count(dsn: str, upto: int | None = None) -> int:
    """``SELECT count(*)`` over the peek: decoding on the server, nothing sent."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {peek}").format(peek=peek_call(upto))).fetchone()
    assert row is not None
    return int(row[0])


# --- our side ---------------------------------------------------------------------------------


def read_only(dsn: str, upto: int) -> int:
    """The real SlotSource.read_window (COPY, blocks framed in C), chunks dropped; returns rows."""
    with SlotSource(dsn, SLOT, PUB) as src:
        for item in src.read_window(upto, max_changes=None, max_bytes=None):
            if isinstance(item, WindowRead):
                return item.rows
    raise AssertionError("read_window ended without its WindowRead")


def capture(dsn: str, upto: int) -> tuple[list[RowChunk], WindowRead, list[bytes]]:
    """The window through the real SlotSource.read_window, and the raw CopyData blocks of the same read."""
    raw: list[bytes] = []
    chunks: list[RowChunk] = []
    read: WindowRead | None = None
    real = sl.copy_blocks

    def recording(conn: Any, statement: Any) -> Iterator[Any]:
        for block in real(conn, statement):
            raw.append(bytes(block))
            yield block

    sl.copy_blocks = recording  # type: ignore[assignment]
    try:
        with SlotSource(dsn, SLOT, PUB) as src:
            for item in src.read_window(upto, max_changes=None, max_bytes=None):
                if isinstance(item, WindowRead):
                    read = item
                else:
                    chunks.append(item)
    finally:
        sl.copy_blocks = real
    assert read is not None
    return chunks, read, raw


def replay_framing(raw: list[bytes], upto: int) -> int:
    """The client half of read_window (blocks gathered, rows framed in C) over captured blocks; returns rows."""
    framer = sl._Framer(None, None, sl.CHUNK_ROWS)
    for _ in framer.chunks(raw, sl.CHUNK_BYTES):
        pass
    return framer.rows


@dataclass
class DecodeResult:
    changes: int
    ops: collections.Counter[str]
    transactions: int
    batches: int


def decode(chunks: list[RowChunk]) -> DecodeResult:
    """Bytes to Arrow: feed every chunk, then finish (no catalog needed for built-in types)."""
    decoder = WindowDecoder()
    out: list[ch.DecodedChunk] = [decoder.feed(c) for c in chunks]
    out.append(decoder.finish())
    ops: collections.Counter[str] = collections.Counter()
    n = batches = txns = 0
    for d in out:
        txns += d.transactions
        for b in d.changes:
            batches += 1
            n += b.batch.num_rows
            for op, count in zip(*b.batch.column(ch.OP_COL).value_counts().flatten(), strict=True):
                ops[str(op)] += int(count.as_py())
        if d.notes.get("incomplete_transaction_rows"):
            raise SystemExit(f"decode: {d.notes['incomplete_transaction_rows']} rows of unfinished transactions")
    return DecodeResult(n, ops, txns, batches)


# --- per-stage breakdown -----------------------------------------------------------------------


class StageTimer:
    """Wraps functions and methods in place to add up the time spent in them (re-entrancy aware)."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._undo: list[Callable[[], None]] = []
        self._depth: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: Any, name: str, label: str | None = None, key: Callable[..., str] | None = None) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        kind = type(original) if isinstance(original, staticmethod | classmethod) else None
        func = original.__func__ if kind else original
        base = label or name

        @functools.wraps(func)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stage = f"{base}[{key(*args)}]" if key else base
            self._depth[stage] += 1
            t0 = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self._depth[stage] -= 1
                if self._depth[stage] == 0:
                    self.seconds[stage] += time.perf_counter() - t0
                    self.calls[stage] += 1

        setattr(owner, name, kind(timed) if kind else timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def stage_breakdown(chunks: list[RowChunk]) -> tuple[float, StageTimer]:
    timer = StageTimer()
    timer.wrap(WindowDecoder, "feed", "feed (total)")
    timer.wrap(ch, "quiescent_cut", "transaction cut")
    timer.wrap(RowChunk, "concat", "RowChunk concat/take")
    timer.wrap(RowChunk, "take", "RowChunk concat/take")
    timer.wrap(ch.po, "parse_message", "control messages (parse_message)")
    # Wrapped where they are looked up: build_batch in changes, walk_changes in rowbatch.
    timer.wrap(ch, "build_batch", "tuples -> batch (total)")
    timer.wrap(rowbatch, "walk_changes", "walk tuples (C)")
    timer.wrap(tm.ColumnCodec, "decode", "codec", key=lambda codec, *a, **k: codec.pg_type)
    t0 = time.perf_counter()
    try:
        decode(chunks)
    finally:
        timer.restore()
    return time.perf_counter() - t0, timer


def profile_decode(chunks: list[RowChunk], top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    decode(chunks)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def rate(n: int, seconds: float) -> str:
    return f"{n / seconds:>12,.0f} changes/s  ({seconds:6.2f} s)"


def add_window_args(ap: argparse.ArgumentParser) -> None:
    """The flags that shape the benchmark window (shared with bench_e2e.py)."""
    ap.add_argument("--changes", type=int, default=1_000_000, help="changes in the window (default 1,000,000)")
    ap.add_argument("--pg", type=int, default=15, choices=(15, 18), help="PostgreSQL major version (default 15)")
    ap.add_argument("--txn-rows", type=int, default=1000, help="rows per transaction (default 1000)")
    ap.add_argument("--update-share", type=float, default=0.25, help="share of the changes that are updates")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_args(ap)
    ap.add_argument("--repeat", type=int, default=3, help="timings per figure; the best counts (default 3)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile one decode pass, print the top N")
    args = ap.parse_args(argv)

    win = make_window(args.pg, args.changes, txn_rows=args.txn_rows, update_share=args.update_share)
    try:
        dsn, n = win.pg.dsn, win.changes
        # The server first: count(*) (decoding only), then the COPY into nothing.
        t_count, counted = best_of(args.repeat, lambda: server_count(dsn, win.upto))
        t_server, (copied, first_row) = best_of(args.repeat, lambda: server_copy(dsn, win.upto))
        t_read, read_rows = best_of(args.repeat, lambda: read_only(dsn, win.upto))
        chunks, read, raw = capture(dsn, win.upto)
        if not counted == copied == read_rows == read.rows:
            raise SystemExit(f"row counts differ: count(*) {counted}, COPY {copied}, read_window {read_rows}/{read.rows}")
        t_frame, framed = best_of(args.repeat, lambda: replay_framing(raw, win.upto))
        assert framed == read.rows
        raw.clear()  # the captured COPY rows are no longer needed
        t_decode, result = best_of(args.repeat, lambda: decode(chunks))
        expected = {"I": win.inserts, "U": win.updates}
        if result.changes != n or dict(result.ops) != expected:
            raise SystemExit(f"decoded {result.changes} changes {dict(result.ops)}, expected {n} {expected}")
        t_staged, timer = stage_breakdown(chunks)

        print(f"window: {read.rows:,} slot rows ({n:,} changes, {result.transactions:,} transactions), "
              f"{read.bytes / 1e6:.1f} MB of COPY rows, {len(chunks)} chunks, {result.batches} Arrow batches")
        print(f"best of {args.repeat}, rates in changes (Insert/Update messages) per second:")
        print(f"  server  SELECT count(*) FROM peek      {rate(n, t_count)}")
        print(f"  server  COPY (peek) TO STDOUT, dropped {rate(n, t_server)}   <- reference")
        print(f"          (first row after {first_row:.2f} s, in the last of those runs)")
        print(f"  client  read_window (COPY + framing)   {rate(n, t_read)}")
        print(f"  client  framing only (replayed rows)   {rate(n, t_frame)}")
        print(f"  client  decode: feed + finish -> Arrow {rate(n, t_decode)}")
        print(f"  client  framing + decode               {rate(n, t_frame + t_decode)}")
        print(f"decode stages (one instrumented pass, {t_staged:.2f} s; nested stages are part of their parent):")
        for stage, secs in sorted(timer.seconds.items(), key=lambda kv: -kv[1]):
            print(f"  {stage:<44} {secs:7.3f} s  {100 * secs / t_staged:5.1f}%  ({timer.calls[stage]} calls)")
        if args.profile:
            print(profile_decode(chunks, args.profile))
        print(f"framing_decode_vs_server={(n / (t_frame + t_decode)) / (n / t_server):.2f}")
        print(f"decode_vs_server={(n / t_decode) / (n / t_server):.2f}")
    finally:
        win.pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
