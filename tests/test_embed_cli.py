"""`egemma-embed` (egemma.client.embed) against the real server: a few hundred mixed rows in JSONL, text and
Parquet, every vector against the single-request embedding of its text, ids and order kept; .npy output and the
request options; bad rows listed with their line numbers (found client-side, or refused by the server inside a
batch); the client SIGKILLed or SIGTERMed mid-run, then resumed; the server killed mid-run and restarted by the
watchdog. CPU note: the fp32 CPU engine is not batch invariant (a text batched with others differs from it alone
by ~2e-7), so vectors are compared with helpers.assert_close (1e-5), num_tokens exactly."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tritonclient.grpc as grpcclient

from helpers import assert_close, make_texts, max_text_bytes, text_input, wait_for

pytestmark = pytest.mark.usefixtures("still_serving")
EMBED = Path(sys.executable).with_name("egemma-embed")  # the console script pyproject installs
N = 240


def single(url: str, texts: list[str], **params) -> tuple[np.ndarray, np.ndarray]:
    """Each text alone in its own request, one after another: (vectors, num_tokens)."""
    c = grpcclient.InferenceServerClient(url)
    vecs, toks = [], []
    for t in texts:
        r = c.infer("embeddinggemma", [text_input([t])], parameters=params or None, client_timeout=60)
        vecs.append(r.as_numpy("EMBEDDING")[0])
        toks.append(int(r.as_numpy("NUM_TOKENS")[0, 0]))
    return np.stack(vecs), np.array(toks)


@pytest.fixture(scope="module")
def corpus(server):
    """N texts of up to 40 words with unicode and literal special tokens (no newline: the text format is a line per
    document; none empty: an empty text is a bad row), ids doc-0.., and each text's single-request embedding."""
    texts = [t.replace("\n", " ") or f"text {k}" for k, t in enumerate(make_texts(N, 40, seed=35))]
    vecs, toks = single(server.grpc_url, texts)
    return texts, [f"doc-{k}" for k in range(N)], vecs, toks


def embed(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([str(EMBED), *map(str, args), "--progress", "log"], capture_output=True, text=True,
                          timeout=timeout)


def start(*args) -> subprocess.Popen:
    return subprocess.Popen([str(EMBED), *map(str, args), "--progress", "none"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def write_jsonl(path: Path, texts, ids, extra: list[str] = ()) -> list[int]:
    """One object a line, a blank line and a CRLF line among them, `extra` raw lines at the end; returns each
    text's line number."""
    lines, where = [], []
    for k, (t, i) in enumerate(zip(texts, ids)):
        if k == 5:
            lines.append("")
        where.append(len(lines) + 1)
        lines.append(json.dumps({"id": i, "text": t}, ensure_ascii=k % 2 == 0) + ("\r" if k == 7 else ""))
    path.write_text("\n".join([*lines, *extra]) + "\n", encoding="utf-8")
    return where


def check(path: Path, texts_idx, lines, ids, vecs, toks):
    """The Parquet output has exactly these rows, in this order, with these vectors and token counts."""
    t = pq.read_table(path)
    assert t["line"].to_pylist() == list(lines)
    if ids is not None:
        assert t["id"].to_pylist() == list(ids)
    assert t["num_tokens"].to_pylist() == toks[texts_idx].tolist()
    assert t.schema.field("embedding").type == pa.list_(pa.float32(), vecs.shape[1])
    assert_close(np.stack(t["embedding"].to_numpy(zero_copy_only=False)), vecs[texts_idx])


@pytest.mark.parametrize("fmt", ["jsonl", "text", "parquet"])
def test_every_format_embeds_every_row_in_order(server, corpus, tmp_path, fmt):
    texts, ids, vecs, toks = corpus
    idx = np.arange(N)
    if fmt == "jsonl":
        src, lines, args = tmp_path / "in.jsonl.gz", None, ["--id-field", "id", "--batch", 16]
        plain = tmp_path / "in.jsonl"
        lines = write_jsonl(plain, texts, ids)
        subprocess.run(["gzip", str(plain)], check=True)  # read through pyarrow's decompression
    elif fmt == "text":  # a blank line is no document
        src, args, ids = tmp_path / "in.txt", ["--batch", 7, "--inflight", 3], None
        body = [x for k, t in enumerate(texts) for x in ([" \t", ""] if k in (2, 5) else []) + [t]]
        src.write_text("\n".join(body) + "\n", encoding="utf-8")
        lines = [n for n, x in enumerate(body, 1) if x.strip(" \t")]
    else:
        src, args = tmp_path / "in.parquet", ["--column", "body", "--id-field", "key", "--batch", 64]
        pq.write_table(pa.table({"key": ids, "body": texts}), src, row_group_size=50)
        lines = list(range(1, N + 1))
    out = tmp_path / "out.parquet"
    r = embed(src, "-o", out, "--url", server.grpc_url, "--row-group", 100, "--summary-json", tmp_path / "s.json",
              *args)
    assert r.returncode == 0, r.stderr
    check(out, idx, lines, ids, vecs, toks)
    s = json.loads((tmp_path / "s.json").read_text())
    assert (s["status"], s["rows"], s["tokens"], s["bad_rows"]) == ("done", len(idx), int(toks[idx].sum()), 0), s
    assert f"{len(idx):,} rows" in r.stderr and "docs/s" in r.stderr
    assert not (tmp_path / "out.parquet.partial").exists() and not (tmp_path / "out.parquet.errors.jsonl").exists()
    md, batch = pq.ParquetFile(out).metadata, args[args.index("--batch") + 1]
    sizes = [md.row_group(k).num_rows for k in range(md.num_row_groups)]  # a part: --row-group rows, whole batches
    assert len(sizes) >= 2 and all(100 <= n < 100 + batch for n in sizes[:-1]) and sum(sizes) == len(idx), sizes
    again = embed(src, "-o", out, "--url", server.grpc_url, *args)  # complete: nothing to do
    assert again.returncode == 0 and "complete already" in again.stderr, again.stderr


def test_npy_output_with_dimensions_prompt_and_binary(server, corpus, tmp_path):
    texts, ids, _, _ = corpus
    sub = texts[:64]
    vecs, toks = single(server.grpc_url, sub, prompt_name="query", dimensions=32)
    src = tmp_path / "in.jsonl"
    write_jsonl(src, sub, ids[:64])
    r = embed(src, "-o", tmp_path / "v.npy", "--url", server.grpc_url, "--prompt-name", "query",
              "--dimensions", 32, "--id-field", "id")
    assert r.returncode == 0, r.stderr
    assert_close(np.load(tmp_path / "v.npy"), vecs)
    meta = [json.loads(x) for x in (tmp_path / "v.npy.ids.jsonl").read_text().splitlines()]
    assert [m["id"] for m in meta] == ids[:64] and [m["num_tokens"] for m in meta] == toks.tolist()
    r = embed(src, "-o", tmp_path / "b.parquet", "--url", server.grpc_url, "--prompt-name", "query",
              "--dimensions", 32, "--encoding", "ubinary")
    assert r.returncode == 0, r.stderr
    t = pq.read_table(tmp_path / "b.parquet")
    assert t.schema.field("embedding").type == pa.list_(pa.uint8(), 4) and "id" not in t.schema.names
    got = np.unpackbits(np.stack(t["embedding"].to_numpy(zero_copy_only=False)), axis=1)
    sure = np.abs(vecs) > 1e-5  # a sign bit of a value within the batch noise of 0 may go either way
    assert (got.astype(bool) == (vecs > 0))[sure].all()


def test_bad_rows_go_to_the_errors_file_with_their_line_numbers(server, corpus, tmp_path):
    """Client-side (not JSON, not UTF-8, no field, not a string, a lone surrogate, no id, over max_text_bytes)
    and server-side: a text of exactly max_text_bytes passes here, but with the prompt the server refuses it,
    which fails its whole batch: the batch is split until that row is found; the others are embedded."""
    texts, ids, _, _ = corpus
    limit = max_text_bytes(server)
    good = texts[:30]
    vecs, toks = single(server.grpc_url, good, prompt_name="document")
    src = tmp_path / "in.jsonl"
    bad = {3: b"not json", 8: b'{"id": "u", "text": "caf\xe9"}', 11: b'{"id": "m", "body": "no text field"}',
           14: b'{"id": "n", "text": 42}', 17: b'{"id": "s", "text": "\\ud800 lone"}', 20: b'{"text": "no id"}',
           23: json.dumps({"id": "big", "text": "a" * (limit + 1)}).encode(),
           26: json.dumps({"id": "edge", "text": "b" * limit}).encode()}
    lines, numbers, g = [], [], iter(zip(good, ids))
    for n in range(1, len(good) + len(bad) + 1):
        if n in bad:
            lines.append(bad[n])
        else:
            t, i = next(g)
            numbers.append(n)
            lines.append(json.dumps({"id": i, "text": t}).encode())
    src.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.parquet"
    r = embed(src, "-o", out, "--url", server.grpc_url, "--id-field", "id", "--prompt-name", "document",
              "--batch", 8)
    assert r.returncode == 1, r.stderr
    errors = [json.loads(x) for x in (tmp_path / "out.parquet.errors.jsonl").read_text().splitlines()]
    assert [e["line"] for e in errors] == sorted(bad), errors
    why = {e["line"]: e["reason"] for e in errors}
    for n, fragment in {3: "not JSON", 8: "not valid UTF-8", 11: "no field 'text'", 14: "int, not a string",
                        17: "lone surrogate", 20: "id field 'id' is missing", 23: "max_text_bytes",
                        26: "refused by the server"}.items():
        assert fragment in why[n], (n, why[n])
    assert errors[-1]["id"] == "edge" and "max_text_bytes" in why[26]
    check(out, np.arange(len(good)), numbers, ids[:len(good)], vecs, toks)
    assert "8 bad rows" in r.stderr


def test_the_client_killed_or_stopped_mid_run_resumes_without_a_gap_or_duplicate(server, corpus, tmp_path):
    texts, ids, vecs, toks = corpus
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    lines = write_jsonl(src, texts, ids)
    partial = tmp_path / "out.parquet.partial"
    args = [src, "-o", out, "--url", server.grpc_url, "--id-field", "id", "--batch", 2, "--inflight", 1,
            "--row-group", 16]
    for sig, parts in ((signal.SIGKILL, 2), (signal.SIGTERM, 5)):
        p = start(*args)
        wait_for(lambda: len(list(partial.glob("part-*"))) >= parts or p.poll() is not None, 120,
                 f"{parts} parts written")
        assert p.poll() is None, "the run finished before it was killed: make it slower"
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
        if sig == signal.SIGTERM:
            assert p.returncode == 4 and "stopped by SIGTERM" in err and "resume" in err, (p.returncode, err)
        else:
            assert p.returncode == -signal.SIGKILL
        assert not out.exists() and partial.is_dir()
        done = pq.read_table(partial)  # what is done reads as one dataset
        assert done["line"].to_pylist() == lines[:done.num_rows]
    r = embed(*args)
    assert r.returncode == 0, r.stderr
    assert "resumed after line" in r.stderr
    check(out, np.arange(N), lines, ids, vecs, toks)


def test_resume_refuses_other_settings_and_usage_errors_exit_2(server, corpus, tmp_path):
    texts, ids, _, _ = corpus
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    write_jsonl(src, texts[:20], ids[:20])
    r = embed(src, "-o", out, "--url", server.grpc_url, "--prompt-name", "no-such-prompt")
    assert r.returncode == 2 and "no-such-prompt" in r.stderr, r.stderr
    (tmp_path / "out.parquet.partial").mkdir()
    (tmp_path / "out.parquet.partial" / "_run.json").write_text(json.dumps({"input": str(src), "dimensions": 16}))
    r = embed(src, "-o", out, "--url", server.grpc_url)
    assert r.returncode == 2 and "other settings" in r.stderr and "--overwrite" in r.stderr, r.stderr
    r = embed(src, "-o", out, "--url", server.grpc_url, "--overwrite")
    assert r.returncode == 0 and pq.read_table(out).num_rows == 20, r.stderr
    r = embed(src, "-o", out, "--url", server.grpc_url, "--dimensions", 16)  # complete, but not with these
    assert r.returncode == 2 and "other settings" in r.stderr and "dimensions: None -> 16" in r.stderr, r.stderr
    pq.write_table(pa.table({"a": [1]}), tmp_path / "theirs.parquet")
    for args, says in (([src, "-o", tmp_path / "theirs.parquet"], "not written by egemma-embed"),
                       ([src, "-o", tmp_path / "out.csv"], ".parquet or .npy"),
                       ([tmp_path / "missing.jsonl", "-o", tmp_path / "m.parquet"], "no input file"),
                       ([src, "-o", out, "--batch", 65], "--batch must be 1-64")):
        r = embed(*args, "--url", server.grpc_url)
        assert r.returncode == 2 and says in r.stderr, (args, r.stderr)
    assert pq.read_table(tmp_path / "theirs.parquet").num_rows == 1


def test_the_server_killed_mid_run_is_retried_until_the_watchdog_restarted_it(start_server, corpus, tmp_path):
    """SIGKILL of tritonserver while the client runs: its requests fail (UNAVAILABLE), the watchdog restarts the
    server on the same ports, the client retries and completes: every row once, in order, exact."""
    from egemma.ops.tritonserver import free_port
    from egemma.ops.watchdog import Watchdog
    texts, ids, vecs, toks = corpus
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    lines = write_jsonl(src, texts, ids)
    with Watchdog(lambda: start_server(**ports)) as wd:
        p = start(src, "-o", out, "--url", wd.server.grpc_url, "--id-field", "id", "--batch", 4, "--inflight", 2,
                  "--row-group", 16, "--retry-for", 120, "--summary-json", tmp_path / "s.json")
        wait_for(lambda: len(list((tmp_path / "out.parquet.partial").glob("part-*"))) >= 1 or p.poll() is not None,
                 120, "a part written")
        assert p.poll() is None, "the run finished before the server was killed: make it slower"
        os.kill(wd.server.proc.pid, signal.SIGKILL)
        wait_for(lambda: wd.events, 60, "the watchdog to restart the server")
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["retries"] >= 1 and s["rows"] == N, s
    check(out, np.arange(N), lines, ids, vecs, toks)


def test_an_empty_text_is_a_bad_row_as_the_http_routes_refuse_it(server, corpus, tmp_path):
    """One rule with the OpenAI and TEI routes, which answer "" with a 400: reported, never embedded."""
    texts, ids, vecs, toks = corpus
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    src.write_text("\n".join(json.dumps({"id": i, "text": t}) for i, t in
                             [(ids[0], texts[0]), ("empty", ""), (ids[1], texts[1])]) + "\n")
    r = embed(src, "-o", out, "--url", server.grpc_url, "--id-field", "id")
    assert r.returncode == 1, r.stderr
    errors = [json.loads(x) for x in (tmp_path / "out.parquet.errors.jsonl").read_text().splitlines()]
    assert errors == [{"line": 2, "id": "empty", "reason": "text is empty"}]
    check(out, np.arange(2), [1, 3], ids[:2], vecs, toks)


class SignalAtEnd:
    """stdin whose end, when the reader reaches it, sends this process SIGTERM: the signal comes once every row
    was read and sent (the rows fill whole batches), before their answers are in."""

    def __init__(self, data: bytes):
        self.data, self.closed = data, False

    def read(self, n=-1) -> bytes:
        if not self.data:
            os.kill(os.getpid(), signal.SIGTERM)
            return b""
        chunk, self.data = (self.data, b"") if n is None or n < 0 else (self.data[:n], self.data[n:])
        return chunk


def test_a_signal_after_every_row_was_sent_finishes_the_output(server, corpus, tmp_path, monkeypatch, capsys):
    """SIGTERM once every row is in flight: nothing is unfinished, so the output is finished and the exit code is
    0, not 4 with "run again to resume"."""
    import asyncio
    import types
    from egemma.client.embed import embed as run_embed, parse_args
    texts, ids, vecs, toks = corpus
    data = "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids[:16], texts[:16])).encode()
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=SignalAtEnd(data)))
    out = tmp_path / "out.parquet"
    a = parse_args(["-", "--format", "jsonl", "-o", str(out), "--url", server.grpc_url, "--id-field", "id",
                    "--batch", "4", "--inflight", "4", "--progress", "none"])
    code = asyncio.run(run_embed(a))
    err = capsys.readouterr().err
    assert code == 0 and "every row was sent and answered" in err and "resume" not in err, (code, err)
    check(out, np.arange(16), range(1, 17), ids[:16], vecs, toks)


def test_progress_in_a_terminal_without_a_window_size(server, corpus, tmp_path):
    """A pty nobody sized (0 x 0, as under some CI runners and `script`) still shows the bar."""
    import pty
    texts, ids, _, _ = corpus
    src = tmp_path / "in.jsonl"
    write_jsonl(src, texts[:40], ids[:40])
    m, s = pty.openpty()
    p = subprocess.Popen([str(EMBED), str(src), "-o", str(tmp_path / "out.parquet"), "--url", server.grpc_url],
                         stdin=s, stdout=s, stderr=s, close_fds=True)
    os.close(s)
    shown = b""
    while chunk := _read(m):
        shown += chunk
    assert p.wait(120) == 0
    assert b"100%|" in shown and b"40/" in shown.replace(b"40.0/", b"40/") or b"100%" in shown, shown[-500:]


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # the other end closed: EIO
        return b""


def test_the_eta_is_measured_on_answers_not_on_the_start(monkeypatch):
    """A slow start (probe, connections, the server's first batches) must not inflate the first ETA."""
    from egemma.client import progress
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    p = progress.Progress("log", total=1000, unit="B", start=0)
    now[0] += 60  # a minute before the first answer
    for pos in (100, 200, 300):
        p.update(pos, 10, 100, 0, 0)
        now[0] += 1
    assert p.eta() == ", ETA 0 min 07 s", p.eta()  # 700 B left at 100 B/s; from the start it would say 2 min 33 s
