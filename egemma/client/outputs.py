"""egemma-embed's output. While it runs, what is done lives in OUTPUT.partial/: `_run.json` (the settings, so that a
resume with other options is refused) and parts `part-FIRST-LAST.parquet`, each a complete Parquet file with the
embedded rows of input lines FIRST..LAST, written under a hidden name, synced and renamed in, so that a kill at any
moment leaves only whole parts (the directory reads as one Parquet dataset). Bad rows go to OUTPUT.errors.jsonl
before the part covering them. Each part also goes to the final OUTPUT, written beside them (egemma.client.final);
when the input is done that is renamed in and OUTPUT.partial/ removed. A resume continues after the last part's
LAST, dropping any error entry past it, and starts the final OUTPUT again from the parts."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from egemma.client.final import COMPRESSION, DTYPES, META, Final, hidden, sync_replace
from egemma.client.inputs import UsageError

PART = re.compile(r"^part-(\d{12})-(\d{12})\.parquet$")
ID_TYPES = {"int": pa.int64(), "str": pa.string(), None: pa.string()}
# --chunks: a row per window, its number in the text and its text tokens and characters [start, end)
CHUNK_COLUMNS = ("chunk", "token_start", "token_end", "char_start", "char_end")


def out_format(path: Path) -> str:
    if path.suffix.lower() in (".parquet", ".pq"):
        return "parquet"
    if path.suffix.lower() == ".npy":
        return "npy"
    raise UsageError(f"cannot tell the output format of {str(path)!r}: name it .parquet or .npy")


def sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def differences(before: dict, now: dict) -> str:
    """The settings of `now` that `before` has otherwise, as `key: before -> now`."""
    return "; ".join(f"{k}: {before.get(k)!r} -> {v!r}" for k, v in now.items() if before.get(k) != v)


class Output:
    def __init__(self, path: Path):
        self.path, self.fmt = path, out_format(path)
        self.partial, self.errors = sibling(path, ".partial"), sibling(path, ".errors.jsonl")
        self.ids = sibling(path, ".ids.jsonl")
        self.final: Final | None = None  # opened at the first part with rows
        self.settings, self.before = {}, []  # the parts a resume found

    def complete(self, settings: dict) -> bool:
        """Whether OUTPUT is a finished run of these settings (a UsageError if it is another file or run)."""
        if not self.path.exists() or self.partial.exists():
            return False
        if self.fmt == "parquet":
            meta = (pq.read_schema(self.path).metadata or {}).get(META)
            if meta is None:
                raise UsageError(f"{self.path} exists and was not written by egemma-embed: --overwrite replaces it")
            if changed := differences(json.loads(meta), settings):
                raise UsageError(f"{self.path} is complete, from other settings ({changed}): --overwrite embeds "
                                 "again")
        return True

    def remove(self):
        shutil.rmtree(self.partial, ignore_errors=True)
        for p in (self.path, self.errors, self.ids):
            p.unlink(missing_ok=True)

    def parts(self) -> list[tuple[int, int, Path]]:
        found = sorted((int(m[1]), int(m[2]), p) for p in self.partial.iterdir() if (m := PART.match(p.name)))
        out, last = [], 0
        for first, end, p in found:  # parts are written in order: a gap can only follow a foreign file
            if first != last + 1:
                break
            out.append((first, end, p))
            last = end
        return out

    def begin(self, settings: dict) -> tuple[int, int, int, object]:
        """Start or resume: (last input line done, rows done, tokens done, the id type the parts have)."""
        manifest = self.partial / "_run.json"  # "_": not read as data by Parquet dataset readers
        self.settings = settings
        for p in (self.path, self.ids):
            hidden(p).unlink(missing_ok=True)  # a final output a kill left unfinished
        if not self.partial.exists():
            self.errors.unlink(missing_ok=True)  # from an earlier run into this name, not continued
            self.partial.mkdir(parents=True)
            manifest.write_text(json.dumps(settings, indent=1))
            return 0, 0, 0, None
        try:
            before = json.loads(manifest.read_text())
        except (OSError, ValueError):
            raise UsageError(f"{self.partial} has no readable _run.json: not a partial output of egemma-embed? "
                             "Remove it, or give --overwrite") from None
        if changed := differences(before, settings):
            raise UsageError(f"{self.partial} was made with other settings ({changed}): resume with the same ones, "
                             "or give --overwrite to start again")
        for p in self.partial.glob(".part-*"):
            p.unlink()  # a part whose writer was killed before its rename
        parts = self.parts()
        self.before = [p for _, _, p in parts]
        done = parts[-1][1] if parts else 0
        self._keep_errors(done)
        rows = tokens = 0
        id_type = None
        for _, _, p in parts:
            t = pq.read_table(p, columns=["num_tokens"])
            rows, tokens = rows + t.num_rows, tokens + int(pc.sum(t["num_tokens"]).as_py() or 0)
            if t.num_rows and id_type is None and "id" in (s := pq.read_schema(p)).names:
                id_type = s.field("id").type
        return done, rows, tokens, id_type

    def _keep_errors(self, done: int):
        """Keep the error entries of lines up to `done`, and none torn by a kill."""
        if not self.errors.exists():
            return
        keep = []
        for line in self.errors.read_bytes().splitlines():
            try:
                if json.loads(line)["line"] <= done:
                    keep.append(line)
            except (ValueError, KeyError):  # a torn last entry
                pass
        tmp = sibling(self.errors, ".tmp")
        tmp.write_bytes(b"".join(x + b"\n" for x in keep))
        sync_replace(tmp, self.errors)

    def n_errors(self) -> int:
        return len(self.errors.read_bytes().splitlines()) if self.errors.exists() else 0

    def make_schema(self, width: int, dtype: np.dtype, with_id: bool, id_type, chunks: bool = False) -> pa.Schema:
        """line, id (with --id-field: an Arrow type, or "int" / "str" as JSONL ids come), with chunks the window's
        CHUNK_COLUMNS, num_tokens, embedding."""
        fields = [pa.field("line", pa.int64())]
        if with_id:
            fields.append(pa.field("id", id_type if isinstance(id_type, pa.DataType) else ID_TYPES[id_type]))
        fields += [pa.field(c, pa.int32()) for c in CHUNK_COLUMNS if chunks]
        return pa.schema([*fields, pa.field("num_tokens", pa.int32()),
                          pa.field("embedding", pa.list_(DTYPES[np.dtype(dtype)], width))])

    def write_part(self, schema: pa.Schema, first: int, last: int, lines, ids, tokens: list[np.ndarray],
                   vectors: list[np.ndarray], bad: list[dict], chunks: list[np.ndarray] = ()):
        """Input lines first..last: the bad rows' entries, then the embedded rows as one part (called in order,
        from one thread). tokens, vectors and chunks (each window's CHUNK_COLUMNS): the batches' arrays, taken
        without a copy."""
        if bad:
            with open(self.errors, "ab") as f:
                f.write(b"".join(json.dumps(b, ensure_ascii=False).encode() + b"\n" for b in bad))
                f.flush()
                os.fsync(f.fileno())
        emb = schema.field("embedding").type
        columns = {"line": pa.array(lines, pa.int64()),
                   "num_tokens": pa.chunked_array([pa.array(t, pa.int32()) for t in tokens], pa.int32()),
                   "embedding": pa.chunked_array([pa.FixedSizeListArray.from_arrays(
                       pa.array(v.reshape(-1), emb.value_type), emb.list_size) for v in vectors], emb)}
        if "id" in schema.names:
            columns["id"] = pa.array(ids, schema.field("id").type)
        if "chunk" in schema.names:
            for k, c in enumerate(CHUNK_COLUMNS):
                columns[c] = pa.chunked_array([pa.array(a[:, k], pa.int32()) for a in chunks], pa.int32())
        table = pa.table([columns[n] for n in schema.names], schema=schema)
        name = f"part-{first:012d}-{last:012d}.parquet"
        tmp = self.partial / f".{name}"
        pq.write_table(table, tmp, compression=COMPRESSION, row_group_size=max(1, table.num_rows))
        sync_replace(tmp, self.partial / name)
        if table.num_rows:
            self._final(schema).append(table)

    def _final(self, schema: pa.Schema) -> Final:
        """The final output, opened with the schema of the first part with rows (the id type known), after the parts
        a resume found."""
        if self.final is None:
            self.final = Final(self.path, self.ids, self.fmt, schema, self.settings)
            for p in self.before:
                if (t := pq.read_table(p)).num_rows:
                    self.final.append(t)
        return self.final

    def finish(self, schema: pa.Schema) -> int:
        """OUTPUT renamed in, the partial directory removed; returns the rows in OUTPUT."""
        rows = self._final(schema).close()
        shutil.rmtree(self.partial)
        return rows

    def discard(self):
        """A stopped run: the unfinished final output goes (the parts stay for a resume)."""
        if self.final is not None:
            self.final.discard()
