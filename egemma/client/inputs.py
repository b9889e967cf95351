"""egemma-embed's input readers, streamed through pyarrow: JSONL (a field of each object), plain text (a line per
document) and Parquet (a column). JSONL and text may be compressed (.gz, .bz2, .zst, .lz4) or '-' (stdin). Each
reader yields Rows in input order with their line number (1-based; for Parquet the row number), a bad row's reason
in place of its text, and says how far it has read (bytes, or rows for Parquet) for the ETA. Blank lines are no
documents: they are skipped, and their line numbers stay unused."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".txt": "text", ".text": "text",
            ".parquet": "parquet", ".pq": "parquet"}
CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}
CHUNK = 1 << 20  # bytes read at a time; lines are split out of these
TEXT_TYPES = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())


class UsageError(Exception):
    """A mistake in the command line or its files that no retry fixes (exit code 2)."""


@dataclass(slots=True)
class Row:
    line: int
    text: bytes | None  # UTF-8; None for a bad row
    id: object = None
    reason: str | None = None  # why the row is bad


def input_format(path: str, given: str | None) -> str:
    if given:
        return given
    p = Path(path)
    suffix = Path(p.stem).suffix if p.suffix in CODECS else p.suffix
    if suffix.lower() not in SUFFIXES:
        raise UsageError(f"cannot tell the format of {path!r} from its name: give --format jsonl, text or parquet")
    return SUFFIXES[suffix.lower()]


def check_text(value, max_bytes: int | None) -> tuple[bytes | None, str | None]:
    """(UTF-8 bytes to send, None) or (None, why the server would refuse it): checked here, where it is cheap, so
    that a bad row does not cost a failed request of 32."""
    if isinstance(value, str):
        try:
            raw = value.encode()
        except UnicodeEncodeError as e:
            return None, f"text is not valid Unicode (a lone surrogate at character {e.start})"
    elif isinstance(value, bytes):
        raw = value
        try:
            raw.decode()
        except UnicodeDecodeError as e:
            return None, f"text is not valid UTF-8 (byte {e.start})"
    else:
        return None, "text is null" if value is None else f"text is a {type(value).__name__}, not a string"
    if not raw:  # one rule with the server's OpenAI and TEI routes, which refuse "" with a 400
        return None, "text is empty"
    if max_bytes is not None and len(raw) > max_bytes:
        return None, f"text has {len(raw)} bytes, over the server's max_text_bytes ({max_bytes})"
    return raw, None


class LineInput:
    """JSONL (`field` of each object, `id_field` as its id) or plain text (the line, no id)."""

    def __init__(self, path: str, fmt: str, field: str, id_field: str | None, max_bytes: int | None,
                 id_type: str | None = None):
        if fmt == "text" and id_field:
            raise UsageError("--id-field needs JSONL or Parquet input: a text line has no fields")
        if path == "-":
            self._raw, self.total = pa.PythonFile(sys.stdin.buffer, mode="r"), None
        else:
            try:
                self._raw = pa.OSFile(path)
            except (OSError, pa.ArrowException) as e:
                raise UsageError(f"cannot read {path}: {e}") from None
            self.total = self._raw.size()
        codec = CODECS.get(Path(path).suffix)
        self._stream = pa.CompressedInputStream(self._raw, codec) if codec else self._raw
        self._exact, self._consumed = codec is None, 0  # uncompressed: the bytes of the lines handed out
        self.fmt, self.field, self.id_field, self.max_bytes = fmt, field, id_field, max_bytes
        self.id_type = id_type  # "int" or "str": the first id seen decides, so that the id column has one type
        self.unit = "B"

    def position(self) -> int:
        return self._consumed if self._exact else self._raw.tell()

    def _lines(self) -> Iterator[bytes]:
        tail: list[bytes] = []
        while chunk := self._stream.read(CHUNK):
            parts = chunk.split(b"\n")
            if len(parts) == 1:  # a line longer than a chunk: collect, joined once
                tail.append(chunk)
                continue
            parts[0] = b"".join([*tail, parts[0]])
            tail = [parts.pop()]
            yield from parts
        if last := b"".join(tail):
            yield last

    def rows(self, after: int = 0) -> Iterator[Row]:
        """Rows after line `after` (a resume's start)."""
        for n, line in enumerate(self._lines(), 1):
            self._consumed += len(line) + 1
            if n <= after or not line or line.isspace():
                continue
            if line.endswith(b"\r"):
                line = line[:-1]
            if self.fmt == "text":
                raw, why = check_text(line, self.max_bytes)
                yield Row(n, raw, None, why)
            else:
                yield self._json_row(n, line)

    def _json_row(self, n: int, line: bytes) -> Row:
        try:
            obj = json.loads(line.decode())
        except UnicodeDecodeError as e:
            return Row(n, None, None, f"line is not valid UTF-8 (byte {e.start})")
        except ValueError as e:
            return Row(n, None, None, f"line is not JSON: {e}")
        if not isinstance(obj, dict):
            return Row(n, None, None, f"line is a JSON {type(obj).__name__}, not an object")
        ident = None
        if self.id_field:
            ident = obj.get(self.id_field)
            kind = "int" if type(ident) is int else "str" if isinstance(ident, str) else None
            if kind is None:
                why = "missing" if self.id_field not in obj else f"a {type(ident).__name__}, not a string or integer"
                return Row(n, None, None, f"id field {self.id_field!r} is {why}")
            self.id_type = self.id_type or kind
            if kind != self.id_type:
                return Row(n, None, ident, f"id {ident!r} is a {kind} where the first ids are {self.id_type}s")
        if self.field not in obj:
            return Row(n, None, ident, f"no field {self.field!r}")
        raw, why = check_text(obj[self.field], self.max_bytes)
        return Row(n, raw, ident, why)


class ParquetInput:
    """A Parquet file's `field` column (string or binary), `id_field` column as ids, read a record batch at a time."""

    def __init__(self, path: str, field: str, id_field: str | None, max_bytes: int | None):
        try:
            self.file = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise UsageError(f"cannot read {path} as Parquet: {e}") from None
        schema = self.file.schema_arrow
        for name in filter(None, (field, id_field)):
            if name not in schema.names:
                raise UsageError(f"{path} has no column {name!r} (columns: {', '.join(schema.names)})")
        if schema.field(field).type not in TEXT_TYPES:
            raise UsageError(f"column {field!r} of {path} is {schema.field(field).type}, not a string column")
        self.field, self.id_field, self.max_bytes = field, id_field, max_bytes
        self.id_type = schema.field(id_field).type if id_field else None
        self.total, self.unit, self._pos = self.file.metadata.num_rows, "rows", 0

    def position(self) -> int:
        return self._pos

    def rows(self, after: int = 0) -> Iterator[Row]:
        md, start, groups = self.file.metadata, 0, []
        for k in range(md.num_row_groups):  # whole row groups before `after` are not read at all
            if not groups and start + md.row_group(k).num_rows <= after:
                start += md.row_group(k).num_rows
            else:
                groups.append(k)
        line = self._pos = start
        columns = [self.field, *([self.id_field] if self.id_field else [])]
        for batch in self.file.iter_batches(batch_size=4096, row_groups=groups, columns=columns):
            texts = batch.column(0).to_pylist()
            ids = batch.column(1).to_pylist() if self.id_field else [None] * len(texts)
            for text, ident in zip(texts, ids):
                line = self._pos = line + 1
                if line <= after:
                    continue
                if self.id_field and ident is None:
                    yield Row(line, None, None, f"id column {self.id_field!r} is null")
                    continue
                raw, why = check_text(text, self.max_bytes)
                yield Row(line, raw, ident, why)


def open_input(path: str, fmt: str, field: str, id_field: str | None, max_bytes: int | None,
               id_type=None) -> LineInput | ParquetInput:
    if fmt == "parquet":
        if path == "-":
            raise UsageError("Parquet cannot be read from stdin: give its path")
        return ParquetInput(path, field, id_field, max_bytes)
    return LineInput(path, fmt, field, id_field, max_bytes, id_type)
