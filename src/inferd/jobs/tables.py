"""The files of ``inferd batch``: JSONL or Parquet in, JSONL or Parquet out.

Input. JSONL is OpenAI's batch input: one ``{"custom_id", "method", "url", "body"}`` object per line. A Parquet
file is the same lines as a table, one row per line, in either of two layouts:

- a ``custom_id`` column and a ``body`` column holding each line's body as JSON text (or as a struct);
- a ``custom_id`` column and one column per body field (``input``, ``model``, ``query``, ``documents`` ...);
  a null leaves the field out of that row's body.

``custom_id`` may be text or an integer (written as text). Each row becomes the JSONL line it stands for
(method POST, url the run's endpoint), so both formats go through the one validation of jobs/lines.py.

Output. JSONL holds OpenAI's batch output records, one per input line. Parquet holds the same records
flattened into the columns of ``OUTPUT_SCHEMA``: ``id``, ``custom_id``, ``status_code`` and ``request_id`` (null
when the line never ran), ``body`` (the endpoint's answer as JSON text) and ``error`` (the record's error object as
JSON text, null when none). Parquet cannot be appended to after a crash, so each committed chunk is a part file
under ``OUT.parts/`` and the parts become OUT when the run ends (removed only after the checkpoint is).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from inferd.jobs.checkpoint import fsync_dir
from inferd.jobs.lines import Record

PARQUET_MAGIC = b"PAR1"
PARQUET_SUFFIXES = (".parquet", ".pq")
OUTPUT_SCHEMA = pa.schema([("id", pa.string()), ("custom_id", pa.string()), ("status_code", pa.int32()),
                           ("request_id", pa.string()), ("body", pa.string()), ("error", pa.string())])
_ROWS_PER_READ = 4096


class BadFile(Exception):
    """An input or output file inferd batch cannot use; the message names the file and what is wrong."""


def is_parquet(path: Path) -> bool:
    """Input: by its first bytes (a Parquet file begins with PAR1), whatever it is called."""
    with open(path, "rb") as f:
        return f.read(4) == PARQUET_MAGIC


def parquet_output(path: Path) -> bool:
    """Output: by its name, as it does not exist yet."""
    return path.suffix.lower() in PARQUET_SUFFIXES


# -- input --------------------------------------------------------------------------------------------------------


def jsonl_lines(path: Path, number: int = 0, offset: int = 0) -> Iterator[tuple[int, bytes, int]]:
    """(line number, line, the offset after it) from line ``number`` at byte ``offset`` on; numbered and split as
    jobs/lines.py ``split`` numbers them (blank lines keep their place: ``parse`` passes over them)."""
    with open(path, "rb") as f:
        f.seek(offset)
        for raw in f:
            offset += len(raw)
            line = raw[:-1] if raw.endswith(b"\n") else raw
            yield number, line[:-1] if line.endswith(b"\r") else line, offset
            number += 1


def _json_typed(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):  # a categorical column (pandas'): its values are what to_pylist gives
        return _json_typed(t.value_type)
    if pa.types.is_struct(t):
        return all(_json_typed(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _json_typed(t.value_type)
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)
            or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t))


def _parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise BadFile(f"{path}: not a readable Parquet file ({exc})") from exc


def check_parquet_input(path: Path) -> int:
    """Refuse a table inferd batch cannot read as lines (naming the column and the fix); its row count."""
    f = _parquet(path)
    schema = f.schema_arrow
    names = schema.names
    if "custom_id" not in names:
        raise BadFile(f"{path}: no custom_id column (columns: {', '.join(names)}); every row needs its id")
    cid = schema.field("custom_id").type
    cid = cid.value_type if pa.types.is_dictionary(cid) else cid
    if not (pa.types.is_string(cid) or pa.types.is_large_string(cid) or pa.types.is_integer(cid)):
        raise BadFile(f"{path}: custom_id is {cid}; it must be text or an integer")
    fields = [n for n in names if n != "custom_id"]
    if not fields:
        raise BadFile(f"{path}: only a custom_id column; give a body column or one column per body field")
    if "body" in fields and len(fields) > 1:
        raise BadFile(f"{path}: a body column beside other columns ({', '.join(n for n in fields if n != 'body')});"
                      " give either the body as one column or one column per body field")
    for name in fields:
        t = schema.field(name).type
        if not _json_typed(t):
            raise BadFile(f"{path}: column {name!r} is {t}, which has no JSON form; cast it to text or a number")
    return f.metadata.num_rows


def parquet_lines(path: Path, endpoint: str, start: int = 0) -> Iterator[tuple[int, bytes, int]]:
    """(row number, the JSONL line it stands for, 0) for each row from row ``start`` on."""
    f = _parquet(path)
    whole_body = "body" in f.schema_arrow.names
    url = json.dumps(endpoint)
    seen = 0
    for batch in f.iter_batches(batch_size=_ROWS_PER_READ):
        if seen + batch.num_rows <= start:
            seen += batch.num_rows
            continue
        first = max(seen, start)
        rows = batch.slice(first - seen).to_pylist()
        seen += batch.num_rows
        for number, row in enumerate(rows, first):
            cid = row.pop("custom_id")
            cid_text = json.dumps(None if cid is None else str(cid), ensure_ascii=False)
            if whole_body:
                body = row["body"]
                # JSON text goes in as written, so a body that is not JSON fails as that line, not the file; its line
                # breaks as spaces, so each row stays one line (pretty-printed JSON has them between its tokens, where
                # a space means the same; inside a JSON string a raw line break is invalid either way).
                body_text = (_one_line(body) if isinstance(body, str)
                             else json.dumps(_whole(body), ensure_ascii=False))
            else:
                body_text = json.dumps({k: _whole(v) for k, v in row.items() if v is not None}, ensure_ascii=False)
            line = f'{{"custom_id": {cid_text}, "method": "POST", "url": {url}, "body": {body_text}}}'
            yield number, line.encode(), 0


def _whole(value: Any) -> Any:
    """Whole-number floats as ints: pandas stores an integer column with nulls as floats, and ``dimensions: 384.0``
    is refused where ``384`` is asked for."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_whole(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    return value


def _one_line(text: str) -> str:
    return text.replace("\r", " ").replace("\n", " ")


# -- output -------------------------------------------------------------------------------------------------------


def _row(record: dict[str, Any]) -> dict[str, Any]:
    response = record.get("response") or None
    error = record.get("error") or None
    return {"id": record.get("id"), "custom_id": record.get("custom_id"),
            "status_code": response.get("status_code") if response else None,
            "request_id": response.get("request_id") if response else None,
            "body": json.dumps(response.get("body"), ensure_ascii=False) if response else None,
            "error": json.dumps(error, ensure_ascii=False) if error else None}


def _record(row: dict[str, Any]) -> dict[str, Any]:
    response = None
    if row["status_code"] is not None:
        response = {"status_code": row["status_code"], "request_id": row["request_id"],
                    "body": json.loads(row["body"]) if row["body"] is not None else None}
    return {"id": row["id"], "custom_id": row["custom_id"], "response": response,
            "error": json.loads(row["error"]) if row["error"] else None}


class JsonlOutput:
    """Appends chunks to OUT; the file is cut back to the committed length first, dropping an uncommitted chunk."""

    def __init__(self, path: Path, committed_bytes: int) -> None:
        self.path = path
        if committed_bytes and (not path.exists() or path.stat().st_size < committed_bytes):
            raise BadFile(f"{path} is shorter than its checkpoint says ({committed_bytes} bytes committed): it was "
                          "changed since; give --restart to start over")
        with open(path, "r+b" if committed_bytes else "wb") as f:
            f.truncate(committed_bytes)
            os.fsync(f.fileno())
        self.size = committed_bytes

    def write_chunk(self, records: Sequence[Record], index: int) -> None:
        data = b"".join(r.data + b"\n" for r in records)
        with open(self.path, "r+b") as f:
            f.seek(self.size)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.size += len(data)

    def finish(self, parts: int) -> None:
        pass  # every chunk is already in place

    def clean_up(self) -> None:
        pass


class ParquetOutput:
    """One part file per chunk (written beside, renamed into place), gathered into OUT at the end."""

    def __init__(self, path: Path, committed_parts: int) -> None:
        self.path = path
        self.size = 0
        self.parts_dir = path.with_name(path.name + ".parts")
        if not committed_parts:
            shutil.rmtree(self.parts_dir, ignore_errors=True)
        elif not all(self.part(i).exists() for i in range(committed_parts)):
            raise BadFile(f"{self.parts_dir} lacks parts its checkpoint counts: it was changed since; give --restart "
                          "to start over")
        self.parts_dir.mkdir(exist_ok=True)

    def part(self, index: int) -> Path:
        return self.parts_dir / f"part-{index:08d}.parquet"

    def write_chunk(self, records: Sequence[Record], index: int) -> None:
        table = pa.Table.from_pylist([_row(orjson.loads(r.data)) for r in records], schema=OUTPUT_SCHEMA)
        part = self.part(index)
        tmp = part.with_name(part.name + ".tmp")
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, part)
        fsync_dir(self.parts_dir)

    def finish(self, parts: int) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with pq.ParquetWriter(tmp, OUTPUT_SCHEMA) as writer:
            for index in range(parts):
                writer.write_table(pq.read_table(self.part(index), schema=OUTPUT_SCHEMA))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)

    def clean_up(self) -> None:
        """The parts, once the checkpoint is gone: until then a resume of the finished run gathers them again (a
        kill between the two left a checkpoint whose parts were deleted, which no resume could finish)."""
        shutil.rmtree(self.parts_dir, ignore_errors=True)


def read_records(path: Path) -> list[dict[str, Any]]:
    """An output file's records, from either format (what a reader of OUT, or a test, compares)."""
    if is_parquet(path):
        return [_record(row) for row in pq.read_table(path, schema=OUTPUT_SCHEMA).to_pylist()]
    return [orjson.loads(line) for _, line, _ in jsonl_lines(path) if line.strip()]
