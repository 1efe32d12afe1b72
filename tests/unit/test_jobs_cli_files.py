"""``inferd batch``'s files: Parquet rows read as the JSONL lines they stand for (both layouts), the refusals of a
table it cannot read, line numbers as jobs/lines.py gives them, outputs that drop an uncommitted chunk on resume,
and a checkpoint that never resumes another run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from inferd.jobs import checkpoint, offline
from inferd.jobs.checkpoint import Checkpoint, CheckpointError
from inferd.jobs.lines import Line, Record, endpoint_of, parse, parse_all, split
from inferd.jobs.tables import (
    BadFile,
    JsonlOutput,
    ParquetOutput,
    check_parquet_input,
    is_parquet,
    jsonl_lines,
    parquet_lines,
    read_records,
)

EMBEDDINGS = endpoint_of("/v1/embeddings")


def table(path: Path, columns: dict[str, list], **types: pa.DataType) -> Path:
    pq.write_table(pa.table({k: pa.array(v, type=types.get(k)) for k, v in columns.items()}), path)
    return path


def lines_of(path: Path, start: int = 0) -> list[Line | Record | None]:
    return [parse(raw, number, EMBEDDINGS) for number, raw, _ in parquet_lines(path, EMBEDDINGS.path, start)]


def test_parquet_field_columns_become_bodies_nulls_left_out_and_integer_ids_text(tmp_path: Path) -> None:
    path = table(tmp_path / "in.parquet", {"custom_id": [7, 8, 9], "input": ["a", "b", "c"],
                                           "dimensions": [None, 16, None]})
    assert is_parquet(path) and check_parquet_input(path) == 3
    assert lines_of(path) == [Line(0, "7", {"input": "a"}), Line(1, "8", {"input": "b", "dimensions": 16}),
                              Line(2, "9", {"input": "c"})]
    assert lines_of(path, start=2) == [Line(2, "9", {"input": "c"})]  # a resume starts at its row, numbered alike


def test_parquet_body_column_as_json_text_or_struct(tmp_path: Path) -> None:
    text = table(tmp_path / "text.parquet", {"custom_id": ["x", "y"],
                                             "body": ['{"input": ["hi", "there"]}', '{"input": oops}']})
    good, broken = lines_of(text)
    assert good == Line(0, "x", {"input": ["hi", "there"]})
    # Text that is not JSON fails as its own line, with the parser's reason, not as the whole file.
    assert isinstance(broken, Record) and not broken.ok
    assert orjson.loads(broken.data)["error"]["code"] == "invalid_json"
    struct = table(tmp_path / "struct.parquet", {"custom_id": ["s"], "body": [{"input": "one", "user": "u"}]})
    assert lines_of(struct) == [Line(0, "s", {"input": "one", "user": "u"})]


def test_parquet_bodies_as_pretty_printed_json_are_one_line_each(tmp_path: Path) -> None:
    """Issue: rows were joined with newlines and split again, so an indented body was many lines and the file was
    refused as "not JSONL"; and a broken body with line breaks must not count as several lines."""
    pretty = json.dumps({"input": ["hi", "there"], "user": "u"}, indent=1)
    path = table(tmp_path / "pretty.parquet", {"custom_id": ["a", "b", "c"],
                                               "body": [pretty, '{"input":\n oops}', "\r\n" + pretty]})
    total, duplicates = offline.source_of(path, EMBEDDINGS).check(1 << 20)
    assert (total, duplicates) == (3, frozenset())
    first, broken, third = lines_of(path)
    assert first == Line(0, "a", {"input": ["hi", "there"], "user": "u"})
    assert third == Line(2, "c", {"input": ["hi", "there"], "user": "u"})
    assert isinstance(broken, Record) and orjson.loads(broken.data)["error"]["code"] == "invalid_json"


def test_parquet_as_pandas_writes_it_whole_number_floats_as_ints_and_categories_decoded(tmp_path: Path) -> None:
    """Issue: an integer column with nulls (pandas makes it float: 16.0) gave ``"dimensions": 16.0``, which the route
    refuses; a categorical (dictionary-encoded) text column was refused as having no JSON form."""
    categories = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0], pa.int32()), pa.array(["a b", "c"]))
    ids = pa.DictionaryArray.from_arrays(pa.array([0, 1, 2], pa.int8()), pa.array(["x", "y", "z"]))
    path = tmp_path / "pandas.parquet"
    pq.write_table(pa.table({"custom_id": ids, "input": categories, "dimensions": pa.array([16.0, None, 8.5])}), path)
    assert pa.types.is_dictionary(pq.read_schema(path).field("input").type)  # as pandas' category dtype writes it
    assert check_parquet_input(path) == 3
    raws = [raw for _, raw, _ in parquet_lines(path, EMBEDDINGS.path)]
    assert [orjson.loads(raw)["body"] for raw in raws] == [{"input": "a b", "dimensions": 16}, {"input": "c"},
                                                            {"input": "a b", "dimensions": 8.5}]
    assert b'"dimensions": 16}' in raws[0]  # an int in the line itself, not 16.0
    struct = table(tmp_path / "struct.parquet", {"custom_id": ["s"], "body": [{"input": "one", "dimensions": 4.0}]})
    assert b'"dimensions": 4}' in next(parquet_lines(struct, EMBEDDINGS.path))[1]


@pytest.mark.parametrize(("columns", "types", "says"), [
    ({"id": ["a"], "input": ["x"]}, {}, "no custom_id column"),
    ({"custom_id": [1.5], "input": ["x"]}, {}, "custom_id is double"),
    ({"custom_id": ["a"]}, {}, "only a custom_id column"),
    ({"custom_id": ["a"], "body": ["{}"], "input": ["x"]}, {}, "a body column beside other columns (input)"),
    ({"custom_id": ["a"], "input": [b"x"]}, {}, "column 'input' is binary"),
    ({"custom_id": ["a"], "when": [0]}, {"when": pa.timestamp("ms")}, "column 'when' is timestamp[ms]"),
])
def test_a_table_that_is_not_lines_is_refused_naming_the_column(tmp_path: Path, columns: dict, types: dict,
                                                                 says: str) -> None:
    with pytest.raises(BadFile, match=re.escape(says)):
        check_parquet_input(table(tmp_path / "bad.parquet", columns, **types))


def test_a_file_that_only_begins_like_parquet_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    path.write_bytes(b"PAR1 and then nothing of the format")
    assert is_parquet(path)
    with pytest.raises(BadFile, match="not a readable Parquet file"):
        check_parquet_input(path)


def test_jsonl_lines_are_numbered_as_lines_split_numbers_them_and_resume_at_an_offset(tmp_path: Path) -> None:
    data = b'{"a": 1}\r\n\n  \n{"b": 2}\n{"c": 3}'  # CRLF, blank lines, no final newline
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    read = list(jsonl_lines(path))
    assert [(n, raw) for n, raw, _ in read] == list(enumerate(split(data)))
    number, _, offset = read[3]
    assert [(n, raw) for n, raw, _ in jsonl_lines(path, number + 1, offset)] == [(4, b'{"c": 3}')]


def records(numbers: range) -> list[Record]:
    lines = [json.dumps({"custom_id": f"c{n}", "method": "POST", "url": "/v1/embeddings", "body": {"nope": 1}})
             .encode() for n in numbers]
    valid, bad = parse_all(lines, numbers.start, EMBEDDINGS, "job")
    assert not valid and len(bad) == len(numbers)  # an unknown body field: each is an error record
    return bad


def test_jsonl_output_drops_what_was_written_after_the_last_commit(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    first = JsonlOutput(out, 0)
    first.write_chunk(records(range(0, 2)), 0)
    committed = first.size
    with open(out, "ab") as f:  # a chunk that a kill -9 cut off before its checkpoint
        f.write(b'{"id":"batch_req_torn","custom_id":"c2","resp')
    resumed = JsonlOutput(out, committed)
    resumed.write_chunk(records(range(2, 4)), 1)
    assert [r["custom_id"] for r in read_records(out)] == ["c0", "c1", "c2", "c3"]
    out.write_bytes(out.read_bytes()[:10])
    with pytest.raises(BadFile, match="shorter than its checkpoint says"):
        JsonlOutput(out, committed)


def test_parquet_output_rewrites_an_uncommitted_part_and_gathers_the_parts_in_order(tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    first = ParquetOutput(out, 0)
    first.write_chunk(records(range(0, 2)), 0)
    first.write_chunk(records(range(7, 9)), 1)  # written, but its checkpoint never was
    resumed = ParquetOutput(out, 1)
    resumed.write_chunk(records(range(2, 4)), 1)
    resumed.finish(2)
    assert resumed.parts_dir.exists()  # until the checkpoint is removed: a resume may gather them again
    resumed.clean_up()
    assert not resumed.parts_dir.exists()
    got = read_records(out)
    assert got == [orjson.loads(r.data) for r in records(range(0, 4))]  # the JSONL records, column by column
    assert pq.read_schema(out).names == ["id", "custom_id", "status_code", "request_id", "body", "error"]
    (tmp_path / "out.parquet.parts").mkdir()
    with pytest.raises(BadFile, match="lacks parts its checkpoint counts"):
        ParquetOutput(out, 1)


def test_a_checkpoint_resumes_only_its_own_run(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    assert checkpoint.load(out) is None
    mine = Checkpoint("ab" * 32, 100, "/v1/embeddings", 10).advanced(4, 1, 5, 60, 300, 1)
    checkpoint.save(out, mine)
    assert checkpoint.load(out) == mine and not mine.finished
    checkpoint.check_resumable(mine, Checkpoint("ab" * 32, 100, "/v1/embeddings", 10), out)
    with pytest.raises(CheckpointError, match="its endpoint differs"):
        checkpoint.check_resumable(mine, Checkpoint("ab" * 32, 100, "/v1/encode", 10), out)
    with pytest.raises(CheckpointError, match="its input file differs"):
        checkpoint.check_resumable(mine, Checkpoint("cd" * 32, 100, "/v1/embeddings", 10), out)
    checkpoint.checkpoint_path(out).write_text("{not json")
    with pytest.raises(CheckpointError, match="give --restart"):
        checkpoint.load(out)
    checkpoint.remove(out)
    assert checkpoint.load(out) is None
