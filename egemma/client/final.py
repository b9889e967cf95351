"""egemma-embed's final OUTPUT, written beside the parts as they come (so that finishing is a close and a rename, not
a copy of everything) under a hidden temporary name: Parquet (a row group per part, the settings in the key-value
metadata under `egemma-embed`), or .npy (its header rewritten with the row count at the end) plus OUTPUT.ids.jsonl
(line, id, num_tokens of each row). A stopped run discards it: the parts are what a resume continues from."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

META = b"egemma-embed"
DTYPES = {np.dtype("float32"): pa.float32(), np.dtype("uint8"): pa.uint8(), np.dtype("int8"): pa.int8()}
COMPRESSION = {"line": "zstd", "id": "zstd", "num_tokens": "zstd", "embedding": "none"}  # floats do not compress
NPY_HEADER = 128  # bytes: magic, version, length and the header dict padded; room for any row count


def hidden(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def sync_replace(tmp: Path, dest: Path):
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash of the machine
    finally:
        os.close(fd)


def npy_header(dtype: np.dtype, rows: int, width: int) -> bytes:
    d = f"{{'descr': {np.lib.format.dtype_to_descr(dtype)!r}, 'fortran_order': False, 'shape': ({rows}, {width}), }}"
    return np.lib.format.magic(1, 0) + struct.pack("<H", NPY_HEADER - 10) + d.ljust(NPY_HEADER - 11).encode() + b"\n"


class Final:
    """OUTPUT (and for .npy its ids file) being written: append(table) per part, in order; close() renames it in."""

    def __init__(self, path: Path, ids: Path, fmt: str, schema: pa.Schema, settings: dict):
        self.path, self.ids, self.fmt, self.rows = path, ids, fmt, 0
        self._f = open(hidden(path), "wb")
        if fmt == "parquet":
            self._w = pq.ParquetWriter(self._f, schema.with_metadata({META: json.dumps(settings).encode()}),
                                       compression=COMPRESSION)
        else:
            emb = schema.field("embedding").type
            self.dtype = next(d for d, t in DTYPES.items() if t == emb.value_type)
            self.width = emb.list_size
            self._f.write(npy_header(self.dtype, 0, self.width))
            self._ids = open(hidden(ids), "w", encoding="utf-8")

    def append(self, table: pa.Table):
        if self.fmt == "parquet":
            self._w.write_table(table, row_group_size=max(1, table.num_rows))
        else:
            flat = table["embedding"].combine_chunks().flatten().to_numpy()
            self._f.write(flat.astype(self.dtype, copy=False).tobytes())
            self._ids.write("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                    for r in table.drop_columns(["embedding"]).to_pylist()))
        self.rows += table.num_rows

    def close(self) -> int:
        if self.fmt == "parquet":
            self._w.close()
        else:
            self._f.seek(0)
            self._f.write(npy_header(self.dtype, self.rows, self.width))
            self._ids.close()
            sync_replace(hidden(self.ids), self.ids)
        self._f.close()
        sync_replace(hidden(self.path), self.path)
        return self.rows

    def discard(self):
        if self.fmt == "parquet":
            self._w.close()
        else:
            self._ids.close()
        self._f.close()
        for p in (self.path, self.ids):
            hidden(p).unlink(missing_ok=True)
