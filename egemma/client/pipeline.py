"""egemma-embed's pipeline: batches of rows sent with a bounded number of requests in flight, answers committed
in input order into parts (egemma.client.outputs) of --row-group rows, written by one thread while the next
requests go on; SIGINT / SIGTERM: the requests in flight are finished (a second signal drops them), what completed
in order is written, and the run stops."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import signal

import numpy as np

from egemma.client.calls import Server, Stopped, Unreachable
from egemma.client.outputs import Output
from egemma.client.progress import Progress

OK, BAD_ROWS, USAGE, FAILED, INTERRUPTED = 0, 1, 2, 3, 4  # the exit codes (egemma.client.embed)


class Run:
    """One run: the part being filled (rows in input order), the part writes pending, and why it stops early."""

    def __init__(self, out: Output, server: Server, progress: Progress, row_group: int, done: int, schema):
        self.out, self.server, self.progress, self.row_group, self.schema = out, server, progress, row_group, schema
        self.writer = concurrent.futures.ThreadPoolExecutor(1, "egemma-embed-writer")
        self.writes: collections.deque = collections.deque()
        self.written = self.last = done  # last input line in a part / in the buffer
        self.buf = Part()
        self.stop_code, self.stop_why, self.signals = None, "", 0

    def on_signal(self, sig: int, tasks):
        self.signals += 1
        if self.signals == 1:
            self.stop(INTERRUPTED, f"stopped by {signal.Signals(sig).name}")
            self.progress.note(f"{signal.Signals(sig).name}: finishing the requests in flight (again: drop them)")
        else:
            for t in tasks():
                t.cancel()

    def stop(self, code: int, why: str):
        if self.stop_code is None:
            self.stop_code, self.stop_why, self.server.stopping = code, why, True

    def commit(self, rows, pos: int, got):
        """A batch's rows into the part being filled; the part is written once it holds --row-group rows."""
        n_bad, good, sent = len(self.buf.bad), 0, 0
        # rows per embedded text: 1, or with chunks its windows
        per = np.bincount(got.of) if got is not None and got.of is not None else None
        for row in rows:
            why = row.reason
            if why is None:
                refused, good = got.refused.get(good), good + 1
                why = refused and f"refused by the server: {refused}"
            if why:
                self.buf.bad.append({"line": row.line, **({"id": row.id} if row.id is not None else {}),
                                     "reason": why})
            else:
                n = 1 if per is None else int(per[sent])
                sent += 1
                self.buf.lines += [row.line] * n
                self.buf.ids += [row.id] * n
        tokens = 0
        if got is not None and got.vectors is not None:
            self.buf.tokens.append(got.tokens)
            self.buf.vectors.append(got.vectors)
            if got.chunks is not None:
                self.buf.chunks.append(got.chunks)
            tokens = int(got.tokens.sum())
        self.last = rows[-1].line
        self.progress.update(pos, good - len(got.refused) if got else 0, tokens, len(self.buf.bad) - n_bad,
                             self.server.retries)
        if len(self.buf.lines) + len(self.buf.bad) >= self.row_group:
            self.flush()

    def flush(self):
        b = self.buf
        if self.last == self.written:
            return
        schema = self.schema()  # the id type is known once a row with an id was read
        self.writes.append(self.writer.submit(self.out.write_part, schema, self.written + 1, self.last, b.lines,
                                              b.ids, b.tokens, b.vectors, b.bad, b.chunks))
        self.written, self.buf = self.last, Part()

    async def settle(self, keep: int):
        """Wait until at most `keep` part writes are pending; a failed write stops the run."""
        while self.writes and (len(self.writes) > keep or self.writes[0].done()):
            try:
                await asyncio.wrap_future(self.writes.popleft())
            except Exception as e:  # a full disk, an id the id column's type cannot take
                self.stop(FAILED, f"cannot write the output: {type(e).__name__}: {e}")


class Part:
    def __init__(self):
        self.lines, self.ids, self.tokens, self.vectors, self.bad, self.chunks = [], [], [], [], [], []


def batches(rows, size: int, position):
    """(rows holding `size` texts to send, the input position after them); bad rows ride along in their place."""
    batch, n = [], 0
    for row in rows:
        batch.append(row)
        n += row.text is not None
        if n == size:
            yield batch, position()
            batch, n = [], 0
    if batch:
        yield batch, position()


async def pipeline(run: Run, rows, position, size: int, inflight: int):
    """Keep `inflight` requests going, commit answers in input order; on a stop, commit what completed in order
    and drop the rest."""
    loop, server = asyncio.get_running_loop(), run.server
    slots, window = asyncio.Semaphore(inflight), collections.deque()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, run.on_signal, sig, lambda: [t for _, _, t in window])

    async def job(batch):
        try:
            texts = [r.text for r in batch if r.text is not None]
            return await server.embed(texts) if texts else None
        finally:
            slots.release()

    async def commit_head() -> bool:
        batch, pos, task = window.popleft()
        try:
            run.commit(batch, pos, await task)
        except (Stopped, asyncio.CancelledError):  # only once the run is stopping
            return False
        except Unreachable as e:
            run.stop(FAILED, f"the server is unreachable: {e}")
            return False
        await run.settle(2)
        return run.stop_code != FAILED

    read_all = False
    for batch, pos in batches(rows, size, position):
        await slots.acquire()
        if run.stop_code is not None:
            break
        window.append((batch, pos, asyncio.create_task(job(batch))))
        while window and (window[0][2].done() or len(window) > 4 * inflight) and run.stop_code is None:
            await commit_head()
    else:
        read_all = True
    while window and (run.stop_code is None or run.stop_code == INTERRUPTED and run.signals < 2):
        if not await commit_head():
            break
    if read_all and not window and run.stop_code == INTERRUPTED:  # the signal came after the last row was sent,
        run.stop_code, run.stop_why = None, ""                    # and every answer is in: nothing is unfinished
        run.progress.note("every row was sent and answered before the signal: finishing the output")
    for _, _, task in window:
        task.cancel()
    run.flush()
    await run.settle(0)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
