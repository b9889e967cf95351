"""egemma-embed's output. While it runs, what is done lives in OUTPUT.partial/: `_run.json` (the settings, so that a
resume with other options is refused) and parts `part-FIRST-LAST.parquet`, each a complete Parquet file with the
embedded rows of input lines FIRST..LAST, written under a hidden name, synced and renamed in, so that a kill at any
moment leaves only whole parts (the directory reads as one Parquet dataset). Bad rows go to OUTPUT.errors.jsonl
before the part covering them. A resume continues after the last part's LAST, dropping any error entry past it.
When the input is done the parts are assembled into OUTPUT: one Parquet file (a row group per part), or OUTPUT.npy
with OUTPUT.ids.jsonl, and OUTPUT.partial/ is removed."""
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

from egemma.client.inputs import UsageError

PART = re.compile(r"^part-(\d{12})-(\d{12})\.parquet$")
META = b"egemma-embed"  # the settings, in the final Parquet file's key-value metadata
DTYPES = {np.dtype("float32"): pa.float32(), np.dtype("uint8"): pa.uint8(), np.dtype("int8"): pa.int8()}
ID_TYPES = {"int": pa.int64(), "str": pa.string(), None: pa.string()}


def out_format(path: Path) -> str:
    if path.suffix.lower() in (".parquet", ".pq"):
        return "parquet"
    if path.suffix.lower() == ".npy":
        return "npy"
    raise UsageError(f"cannot tell the output format of {str(path)!r}: name it .parquet or .npy")


def sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _sync_replace(tmp: Path, dest: Path):
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash of the machine
    finally:
        os.close(fd)


class Output:
    def __init__(self, path: Path):
        self.path, self.fmt = path, out_format(path)
        self.partial, self.errors = sibling(path, ".partial"), sibling(path, ".errors.jsonl")
        self.ids = sibling(path, ".ids.jsonl")
        self.schema: pa.Schema | None = None

    def complete(self) -> bool:
        return self.path.exists() and not self.partial.exists()

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
        changed = [f"{k}: {before.get(k)!r} -> {v!r}" for k, v in settings.items() if before.get(k) != v]
        if changed:
            raise UsageError(f"{self.partial} was made with other settings ({'; '.join(changed)}): resume with "
                             "the same ones, or give --overwrite to start again")
        for p in self.partial.glob(".part-*"):
            p.unlink()  # a part whose writer was killed before its rename
        parts = self.parts()
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
        _sync_replace(tmp, self.errors)

    def n_errors(self) -> int:
        return len(self.errors.read_bytes().splitlines()) if self.errors.exists() else 0

    def make_schema(self, width: int, dtype: np.dtype, with_id: bool, id_type) -> pa.Schema:
        """line, id (with --id-field: an Arrow type, or "int" / "str" as JSONL ids come), num_tokens, embedding."""
        fields = [pa.field("line", pa.int64())]
        if with_id:
            fields.append(pa.field("id", id_type if isinstance(id_type, pa.DataType) else ID_TYPES[id_type]))
        self.schema = pa.schema([*fields, pa.field("num_tokens", pa.int32()),
                                 pa.field("embedding", pa.list_(DTYPES[np.dtype(dtype)], width))])
        return self.schema

    def write_part(self, first: int, last: int, lines, ids, tokens, vectors: np.ndarray, bad: list[dict]):
        """Input lines first..last: the bad rows' entries, then the embedded rows as one part (called in order,
        from one thread)."""
        if bad:
            with open(self.errors, "ab") as f:
                f.write(b"".join(json.dumps(b, ensure_ascii=False).encode() + b"\n" for b in bad))
                f.flush()
                os.fsync(f.fileno())
        emb = self.schema.field("embedding").type
        columns = {"line": pa.array(lines, pa.int64()), "num_tokens": pa.array(tokens, pa.int32()),
                   "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), emb.value_type),
                                                                  emb.list_size)}
        if "id" in self.schema.names:
            columns["id"] = pa.array(ids, self.schema.field("id").type)
        table = pa.table([columns[n] for n in self.schema.names], schema=self.schema)
        name = f"part-{first:012d}-{last:012d}.parquet"
        tmp = self.partial / f".{name}"
        pq.write_table(table, tmp, compression={"line": "zstd", "id": "zstd", "num_tokens": "zstd",
                                                 "embedding": "none"}, row_group_size=max(1, table.num_rows))
        _sync_replace(tmp, self.partial / name)

    def finish(self, settings: dict) -> int:
        """Assemble the parts into OUTPUT and remove the partial directory; returns the rows written."""
        parts = [p for _, _, p in self.parts()]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        if self.fmt == "parquet":
            rows = self._parquet(parts, tmp, settings)
        else:
            rows = self._npy(parts, tmp)
        _sync_replace(tmp, self.path)
        shutil.rmtree(self.partial)
        return rows

    def _parquet(self, parts: list[Path], tmp: Path, settings: dict) -> int:
        schema = self.schema.with_metadata({META: json.dumps(settings).encode()})
        rows = 0
        with pq.ParquetWriter(tmp, schema, compression={"line": "zstd", "id": "zstd", "num_tokens": "zstd",
                                                         "embedding": "none"}) as w:
            for p in parts:
                t = pq.read_table(p)
                if t.num_rows:
                    w.write_table(t.cast(schema), row_group_size=t.num_rows)
                    rows += t.num_rows
        return rows

    def _npy(self, parts: list[Path], tmp: Path) -> int:
        rows = sum(pq.read_metadata(p).num_rows for p in parts)
        emb = self.schema.field("embedding").type
        dtype = next(d for d, t in DTYPES.items() if t == emb.value_type)
        ids_tmp = sibling(self.ids, ".tmp")
        with open(tmp, "wb") as f, open(ids_tmp, "w", encoding="utf-8") as ids:
            np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                     "fortran_order": False, "shape": (rows, emb.list_size)})
            for p in parts:
                t = pq.read_table(p)
                f.write(t["embedding"].combine_chunks().flatten().to_numpy().astype(dtype, copy=False).tobytes())
                for r in t.drop_columns(["embedding"]).to_pylist():
                    ids.write(json.dumps(r, ensure_ascii=False) + "\n")
        _sync_replace(ids_tmp, self.ids)
        return rows
