"""`egemma-embed INPUT -o OUTPUT`: a corpus file through the server's gRPC port into Parquet (or .npy), at the
server's throughput: batches of --batch texts, --inflight requests in flight round-robin over every --url, rows
written in input order a part at a time (egemma.client.outputs), retried while a server restarts, bad rows to
OUTPUT.errors.jsonl, resumable after a kill. Exit codes: 0 done; 1 done, some rows bad; 2 usage (bad option, file
or settings); 3 stopped: a request kept failing for --retry-for s, or the output could not be written; 4 stopped by
SIGINT / SIGTERM. 3 and 4 leave a partial output that the same command resumes."""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
import traceback
from pathlib import Path

from egemma.client.calls import Server, Stopped, Unreachable
from egemma.client.inputs import UsageError, input_format, open_input
from egemma.client.outputs import Output
from egemma.client.pipeline import BAD_ROWS, FAILED, INTERRUPTED, OK, USAGE, Run, pipeline
from egemma.client.progress import Progress, si
from egemma.spec import ENSEMBLE, MAX_BATCH, OUTPUTS


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="egemma-embed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", help="JSONL, text (a line per document) or Parquet; .gz/.bz2/.zst/.lz4 or - for stdin")
    ap.add_argument("-o", "--output", type=Path, required=True, help="OUTPUT.parquet, or OUTPUT.npy (+ .ids.jsonl)")
    ap.add_argument("--url", action="append", help="server gRPC address, repeatable (default 127.0.0.1:8001)")
    ap.add_argument("--field", "--column", default="text", help="JSONL field / Parquet column of the text (text)")
    ap.add_argument("--id-field", help="JSONL field / Parquet column kept as each row's id (rows always keep `line`)")
    ap.add_argument("--format", choices=("jsonl", "text", "parquet"), help="input format (default: from the name)")
    ap.add_argument("--batch", type=int, default=32, help=f"texts a request, 1-{MAX_BATCH} (32)")
    ap.add_argument("--inflight", type=int, default=16, help="requests in flight (16)")
    ap.add_argument("--prompt-name", help="e.g. document, query (default: the server's, no prompt)")
    ap.add_argument("--dimensions", type=int, help="Matryoshka truncation (default: the model's full width)")
    ap.add_argument("--encoding", choices=tuple(OUTPUTS), default="float", help="float, or packed sign bits")
    ap.add_argument("--long-text", default="truncate", help="a text over the model's 2048 tokens: truncate (cut), "
                    "error (a bad row), chunk (its windows' one vector: docs/long-documents.md); the server checks it")
    ap.add_argument("--chunk-overlap", type=int, default=0, help="with --long-text chunk: tokens each window "
                    "repeats of the one before (0)")
    ap.add_argument("--chunks", action="store_true", help="with --long-text chunk: a row per window of each text "
                    "(its line / id, chunk number, token and character span) instead of a row per text")
    ap.add_argument("--model", default=ENSEMBLE, help=argparse.SUPPRESS)
    ap.add_argument("--row-group", type=int, default=8192, help="rows a part / row group: what a kill can lose")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (600)")
    ap.add_argument("--retry-for", type=float, default=300.0, help="seconds a request is retried before the "
                    "run stops with exit code 3 (300)")
    ap.add_argument("--overwrite", action="store_true", help="start again: remove OUTPUT and its partial state")
    ap.add_argument("--progress", choices=("auto", "bar", "log", "none"), default="auto")
    ap.add_argument("--summary-json", type=Path, help="also write the summary to this file as JSON")
    a = ap.parse_args(argv)
    if not 1 <= a.batch <= MAX_BATCH:
        ap.error(f"--batch must be 1-{MAX_BATCH} (the server's max_batch_size)")
    if (a.chunk_overlap or a.chunks) and a.long_text != "chunk":
        ap.error("--chunk-overlap and --chunks apply to --long-text chunk")
    if a.inflight < 1 or a.row_group < 1:
        ap.error("--inflight and --row-group must be at least 1")
    a.url = a.url or ["127.0.0.1:8001"]
    return a


def interrupted(*_):
    raise KeyboardInterrupt  # SIGTERM before or after the pipeline, which handles both signals itself


def summary(a, out: Output, run: Run | None, progress: Progress | None, resumed: tuple, seconds: float,
            wall: float, code: int, why: str) -> dict:
    done, rows0, tokens0 = resumed
    rows = progress.rows if progress else 0
    s = {"status": {OK: "done", BAD_ROWS: "done", FAILED: "failed", INTERRUPTED: "interrupted"}[code],
         "exit_code": code, "output": str(out.path), "rows": rows0 + rows, "tokens": tokens0 + (progress.tokens if
         progress else 0), "rows_this_run": rows, "seconds": round(seconds, 3), "wall_seconds": round(wall, 3),
         "docs_per_s": round(rows / seconds, 1) if seconds else 0.0,
         "tokens_per_s": round(progress.tokens / seconds, 1) if seconds and progress else 0.0,
         "bad_rows": out.n_errors(), "retries": run.server.retries if run else 0,
         "resumed_after_line": done or None, "why": why or None}
    text = (f"{s['rows']:,} rows, {s['tokens']:,} tokens; this run {rows:,} rows in {seconds:.1f} s: "
            f"{s['docs_per_s']:,.0f} docs/s, {si(s['tokens_per_s'])} tokens/s; {s['bad_rows']} bad rows"
            f"{f' (in {out.errors})' if s['bad_rows'] else ''}; {s['retries']} retries")
    if done:
        text += f"; resumed after line {done:,} ({rows0:,} rows done before)"
    where = out.path if code in (OK, BAD_ROWS) else f"{out.partial} (run the same command to resume)"
    print(f"egemma-embed: {s['status']}{f': {why}' if why else ''}: {text} -> {where}", file=sys.stderr)
    if a.summary_json:
        a.summary_json.write_text(json.dumps(s, indent=1))
    return s


async def embed(a) -> int:
    t_start = time.monotonic()
    fmt, out = input_format(a.input, a.format), Output(a.output)
    if a.input != "-" and not Path(a.input).is_file():
        raise UsageError(f"no input file {a.input}")
    settings = {"input": a.input if a.input == "-" else str(Path(a.input).resolve()),
                "input_bytes": None if a.input == "-" else Path(a.input).stat().st_size, "format": fmt,
                "field": a.field, "id_field": a.id_field, "model": a.model, "prompt_name": a.prompt_name,
                "dimensions": a.dimensions, "encoding": a.encoding}
    if a.long_text != "truncate":  # only then: outputs of earlier versions, without these keys, still resume
        settings.update(long_text=a.long_text, chunk_overlap=a.chunk_overlap, chunks=a.chunks)
    if a.overwrite:
        out.remove()
    if out.complete(settings):
        n = out.n_errors()
        print(f"egemma-embed: {out.path} is complete already ({n} bad rows); --overwrite embeds again",
              file=sys.stderr)
        return BAD_ROWS if n else OK
    params = {k: v for k, v in (("prompt_name", a.prompt_name), ("dimensions", a.dimensions),
                                ("encoding", a.encoding), ("long_text", a.long_text),
                                ("chunk_overlap", a.chunk_overlap or None), ("return_chunks", a.chunks or None))
              if v is not None}
    server = Server(a.url, params, a.encoding, a.timeout, a.retry_for, a.model)
    noted = [0.0]

    def on_retry(url, error):
        if time.monotonic() - noted[0] >= 5:  # one line per 5 s while a server is away
            noted[0] = time.monotonic()
            note = progress.note if progress else lambda m: print(f"egemma-embed: {m}", file=sys.stderr)
            note(f"retrying ({server.retries} so far): {url}: {error.status()} {error.message()[:200]}")
    server.on_retry, progress, run, resumed = on_retry, None, None, (0, 0, 0)
    code, why, seconds = OK, "", 0.0
    try:
        width, dtype = await server.probe()
        settings["width"] = int(width)
        done, rows0, tokens0, id_type = out.begin(settings)
        resumed = (done, rows0, tokens0)
        reader = open_input(a.input, fmt, a.field, a.id_field, await server.max_text_bytes(),
                            {"int64": "int", "string": "str"}.get(str(id_type)))

        def schema():
            return out.make_schema(int(width), dtype, bool(a.id_field), id_type or reader.id_type, a.chunks)
        rows = reader.rows(done)
        first = next(rows, None)  # skips what is done, so that the bar starts there
        progress = Progress(a.progress, reader.total, reader.unit, reader.position() if done else 0)
        if done:
            progress.note(f"resuming after line {done:,}: {rows0:,} rows done before")
        run = Run(out, server, progress, a.row_group, done, schema)
        t0 = time.monotonic()
        await pipeline(run, iter(()) if first is None else _chain(first, rows), reader.position, a.batch,
                       a.inflight)
        seconds = time.monotonic() - t0
        progress.close()
        code, why = run.stop_code or OK, run.stop_why
        if code == OK:
            out.finish(schema())
            code = BAD_ROWS if out.n_errors() else OK
        else:
            out.discard()
    except Unreachable as e:
        code, why = FAILED, f"the server is unreachable: {e}"
    except Stopped:
        code, why = INTERRUPTED, "stopped before the first request"
    finally:
        await server.close()
    summary(a, out, run, progress, resumed, seconds, time.monotonic() - t_start, code, why)
    return code


def _chain(first, rows):
    yield first
    yield from rows


def main(argv=None) -> int:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        code = asyncio.run(embed(a))
    except UsageError as e:
        print(f"egemma-embed: {e}", file=sys.stderr)
        code = USAGE
    except KeyboardInterrupt:
        print("egemma-embed: interrupted (nothing lost: run the same command to resume)", file=sys.stderr)
        code = INTERRUPTED
    except Exception:  # a bug or an unreadable file: the traceback, and not the exit code of bad rows
        traceback.print_exc()
        code = FAILED
    sys.exit(code)


if __name__ == "__main__":
    main()
