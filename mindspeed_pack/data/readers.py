"""Read input files as a stream of bounded chunks of rows, without loading a dataset whole.

Formats by extension: ``.parquet`` (record batches), ``.arrow`` (Arrow IPC file or stream,
as HF ``datasets`` writes), ``.csv`` (all columns read as strings), ``.jsonl`` (one object
a line), ``.json`` (an array of objects, JSON lines, or one object of equal-length columns written over several
lines, as HF ``datasets`` reads it), ``.txt`` (one ``text`` row a line).
A directory holds files of exactly one of these formats; a compressed one (``a.jsonl.gz``) is refused, not left
out (the metadata JSON files of an HF
``datasets.save_to_disk`` directory are ignored next to its ``.arrow`` shards).

Text files are UTF-8; a leading byte-order mark (Excel's "CSV UTF-8") is dropped, as pandas
and HF ``datasets`` do. A file in another encoding stops the run with its first undecodable
line and byte offset. An empty CSV file holds no rows (like an empty JSON-lines file).

The main process only cuts the input into chunks; rows are materialised (JSON parsed, Arrow
batches converted) by the worker that encodes them, so parsing scales with ``--workers``.
Nested Parquet/Arrow columns (messages, tool schemas, arguments) are read without the null
fields a struct column adds for keys other rows have (:func:`without_merged_keys`), so a Parquet
file gives the same rows as the JSON lines it was written from, except for key order: a struct
keeps one order of its keys for every row (:func:`struct_objects` finds them; JSON text columns
keep each row's own). Every row carries its location,
``"FILE: line N"`` for line formats and ``"FILE: row N"`` otherwise (1-based), for error messages.
A line that is not valid JSON comes as its :class:`RowError` in place of the row, so the row
policy (stop, or ``--skip-bad-rows``) decides where it is encoded.
"""
from __future__ import annotations

import csv
import io
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from mindspeed_pack.data.digest import sha256_of_files
from mindspeed_pack.data.errors import BAD_CSV, BAD_JSON, BAD_TYPE, PreprocessError, RowError

FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "jsonl", ".txt": "txt"}
# metadata HF datasets' save_to_disk writes next to its .arrow shards: not data
_HF_DATASETS_METADATA = ("state.json", "dataset_info.json", "dataset_dict.json")
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".zip")  # data.jsonl.gz: not read, so never silently left out


@dataclass
class Chunk:
    """Up to ``chunk_rows`` raw rows of one file. ``kind``: lines | rows | arrow."""

    file: str
    first: int  # line or row number of the first element (1-based)
    kind: str
    payload: Any


def resolve_input_files(path, flag: str = "--input") -> list[Path]:
    """The input file, or the files of the one supported format in a directory (sorted); ``flag``: the flag that
    named ``path``, for the error when it is not there."""
    p = Path(path)
    if p.is_file():
        _refuse_compressed([p])
        if p.suffix.lower() not in FORMATS:
            raise PreprocessError(f"{p}: unsupported file extension {p.suffix or '(none)'!r}; "
                                  f"supported: {', '.join(FORMATS)}")
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
        if (p / "dataset_dict.json").is_file() and not any(f.suffix == ".arrow" for f in files):
            splits = sorted(d for d in p.iterdir() if d.is_dir() and any(d.glob("*.arrow")))
            raise PreprocessError(f"{p}: a saved HF DatasetDict (dataset_dict.json), one directory per split; pass "
                                  f"a split's directory: {', '.join(map(str, splits)) or '(none found)'}")
        _refuse_compressed(files)
        by_format: dict[str, list[Path]] = {}
        for f in files:
            if f.name in _HF_DATASETS_METADATA and any(g.suffix == ".arrow" for g in files):
                continue
            if f.suffix.lower() in FORMATS:
                by_format.setdefault(FORMATS[f.suffix.lower()], []).append(f)
        if not by_format:
            raise PreprocessError(f"{p}: no input files; supported extensions: {', '.join(FORMATS)} "
                                  f"(found: {', '.join(f.name for f in files[:10]) or 'nothing'})")
        if len(by_format) > 1:
            detail = "; ".join(f"{fmt}: {len(fs)} file(s)" for fmt, fs in sorted(by_format.items()))
            raise PreprocessError(f"{p}: mixed input formats ({detail}); put one format per directory")
        return next(iter(by_format.values()))
    raise PreprocessError(f"{flag} {str(path)!r} does not exist")


def unread_subdirectories(path) -> list[tuple[Path, int]]:
    """(subdirectory, data files under it) of an input directory: only the directory's own files are read, so a
    shard set split into folders (``DIR/part2/*.parquet``) would be left out without a word. A saved HF dataset's
    split folders and hidden folders are not counted."""
    p = Path(path)
    if not p.is_dir() or (p / "dataset_dict.json").is_file():
        return []
    found = []
    for d in sorted(d for d in p.iterdir() if d.is_dir() and not d.name.startswith((".", "__"))):
        n = sum(1 for f in d.rglob("*") if f.is_file() and f.suffix.lower() in FORMATS
                and not any(part.startswith(".") for part in f.relative_to(d).parts))
        if n:
            found.append((d, n))
    return found


def _refuse_compressed(files) -> None:
    """A compressed data file (``train-0.jsonl.gz``): this reader does not decompress, and in a directory it
    would otherwise be left out without a word while the other files are read."""
    compressed = [f for f in files if len(f.suffixes) > 1 and f.suffixes[-1].lower() in COMPRESSIONS
                  and f.suffixes[-2].lower() in FORMATS]
    if compressed:
        more = f" and {len(compressed) - 3} more" if len(compressed) > 3 else ""
        raise PreprocessError(f"{', '.join(map(str, compressed[:3]))}{more}: compressed input is not read; "
                              f"decompress it first (e.g. gunzip), or move it out of the input")


def fingerprint(files) -> list[dict]:
    """Identity of the inputs for the cache: path, size and a digest of the content.

    Not the modification time: a file edited in place with its size and mtime kept must not
    reuse stale output, and a file only touched need not be tokenised again.
    """
    return [{"path": str(Path(f).resolve()), "size": Path(f).stat().st_size, "sha256": sha256_of_files([f])}
            for f in files]


def count_rows(files) -> Optional[int]:
    """The rows :func:`iter_chunks` will give, where knowing costs no parsing (the tokenize bar's total): Parquet's
    metadata, the non-blank lines of JSON lines and text files (about 0.5 s per 100 MB); None when a file must be
    parsed to tell (a ``.json`` array or object, CSV with its quoted newlines, Arrow streams) or cannot be read
    (the reading pass reports why)."""
    total = 0
    for path in files:
        p = Path(path)
        fmt = FORMATS[p.suffix.lower()]
        if p.stat().st_size == 0:
            continue
        if fmt == "parquet":
            try:
                total += _parquet_file(p).metadata.num_rows
            except PreprocessError:
                return None
        elif fmt in ("jsonl", "txt"):
            with open(p, "rb") as f:
                total += sum(1 for line in f if fmt == "txt" or not line.isspace())
        else:
            return None
    return total


CSV_BLOCK_BYTES = 64 << 20  # the CSV reader's block: the longest quoted value it reads (multi-line answers)
TEXT_ENCODING = "utf-8-sig"  # UTF-8, without the byte-order mark some editors put first


def _parse_json_line(line: str, where: str):
    try:
        return json.loads(line.rstrip("\r\n"))  # a line cut short: the column where it ends, not "line 2, column 1"
    except json.JSONDecodeError as exc:
        return RowError(f"{where}: malformed JSON at column {exc.colno}: {exc.msg}", BAD_JSON)


def not_an_object(where: str, row) -> RowError:
    return RowError(f"{where}: expected an object with named fields, got {type(row).__name__}", BAD_TYPE)


def first_undecodable_line(path) -> Optional[str]:
    """``"line N: byte 0xXX at byte offset B"`` of the first byte that is not UTF-8 (None: all is)."""
    offset = 0
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):  # a UTF-8 sequence never holds a newline byte
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"line {n}: byte 0x{line[exc.start]:02x} at byte offset {offset + exc.start}"
            offset += len(line)
    return None


def not_utf8_error(path) -> PreprocessError:
    where = first_undecodable_line(path) or "somewhere"
    return PreprocessError(f"{path}: {where} is not UTF-8 text; save the file as UTF-8 "
                           "(e.g. iconv -f <its encoding> -t UTF-8)")


@contextmanager
def _utf8_text(path: Path, **kwargs):
    """The file opened as UTF-8 text; a decoding error anywhere in the block names its line and byte."""
    try:
        with open(path, encoding=TEXT_ENCODING, **kwargs) as f:
            yield f
    except UnicodeDecodeError:
        raise not_utf8_error(path) from None


def _looks_like_json_array(path: Path) -> bool:
    with _utf8_text(path) as f:
        while True:
            ch = f.read(1)
            if not ch or not ch.isspace():
                return ch == "["


def _json_columns(path: Path) -> Optional[list]:
    """The rows of a ``.json`` file that is one object of columns written over several lines (``json.dump(...,
    indent=2)`` of a dict of lists, which HF datasets' json loader reads as rows); None when the file is JSON lines
    (its first line a whole value, or the file not one JSON value: its lines are read, and named, one by one)."""
    with _utf8_text(path) as f:
        first = next((line for line in f if line.strip()), "")
    if not first.lstrip().startswith("{"):
        return None
    try:
        json.loads(first)
        return None  # a whole object on its first line: JSON lines
    except json.JSONDecodeError:
        pass
    try:
        with _utf8_text(path) as f:
            value = json.load(f)
    except json.JSONDecodeError:
        return None  # not one JSON value: JSON lines, its malformed lines reported (or skipped) one by one
    columns = list(value.values()) if isinstance(value, dict) else []
    if not columns or not all(isinstance(c, list) and len(c) == len(columns[0]) for c in columns):
        raise PreprocessError(f"{path}: one JSON object that is not columns of equal length; expected a JSON array "
                              "of objects, JSON lines (one object a line), or an object of equal-length columns")
    return [dict(zip(value, cells)) for cells in zip(*columns)]


def _csv_header(path: Path) -> Optional[list[str]]:
    """The header row (None: an empty file)."""
    with _utf8_text(path, newline="") as f:
        return next(csv.reader(f), None)


def columns_of(path, skip_bad_rows: bool = False) -> Optional[list[str]]:
    """Column names of a file (the first record's keys for JSON formats; None if no record).

    A row before the first record that is not a JSON object raises its :class:`RowError`
    (skipped under ``skip_bad_rows``).
    """
    p = Path(path)
    fmt = FORMATS[p.suffix.lower()]
    if p.stat().st_size == 0:
        return None  # an empty file of any format: no rows (a 0-byte Parquet/Arrow file is not even a header)
    if fmt == "txt":
        return ["text"]
    if fmt == "csv":
        return _csv_header(p)  # None for an empty file
    if fmt == "parquet":
        return list(_parquet_schema(p).names)
    if fmt == "arrow":
        return list(_open_arrow(p).schema.names)
    for chunk in iter_chunks([p], 1):
        for where, row in chunk_rows(chunk):
            if isinstance(row, dict):
                return list(row)
            if not skip_bad_rows:
                raise row if isinstance(row, RowError) else not_an_object(where, row)
    return None


def json_keys_present(path, names) -> set:
    """Which of ``names`` some record of a JSON or JSON lines file holds as a key.

    Records of one file may differ in their keys (``tools`` or ``system`` only on the rows that have them; HF
    datasets' json loader, which MindSpeed-LLM and LLaMA-Factory read with, makes such a column null elsewhere), so
    a column named in --map-keys exists when any record has it, not only the first. Stops once all are found;
    rows that are not objects are left to the pass that reads them."""
    wanted, found = set(names), set()
    for chunk in iter_chunks([Path(path)], 1024):
        for _, row in chunk_rows(chunk):
            if isinstance(row, dict):
                found |= wanted & row.keys()
                if found == wanted:
                    return found
    return found


def _not_parquet(path: Path, exc) -> PreprocessError:
    return PreprocessError(f"{path}: not a readable Parquet file ({exc}); a partial download or copy? Write it "
                           "again, or move it out of the input")


def _parquet_schema(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise _not_parquet(path, exc) from None


def _parquet_file(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise _not_parquet(path, exc) from None


def _open_arrow(path: Path):
    import pyarrow as pa

    try:
        return pa.ipc.open_file(path)
    except pa.ArrowInvalid:
        try:
            return pa.ipc.open_stream(path)
        except pa.ArrowInvalid as exc:
            raise PreprocessError(f"{path}: not an Arrow IPC file or stream ({exc})") from None


def _arrow_batches(path: Path):
    reader = _open_arrow(path)
    if hasattr(reader, "num_record_batches"):
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader


def iter_chunks(files, chunk_rows: int) -> Iterator[Chunk]:
    """Stream every file as chunks of at most ``chunk_rows`` rows, in file and row order."""
    for path in files:
        path = Path(path)
        name = str(path)
        fmt = FORMATS[path.suffix.lower()]
        if path.stat().st_size == 0:
            continue  # an empty file: no rows, whatever its format
        columns = _json_columns(path) if fmt == "json" and not _looks_like_json_array(path) else None
        if columns is not None:  # one object of columns: its rows, numbered as an array's
            for start in range(0, len(columns), chunk_rows):
                yield Chunk(name, start + 1, "rows", columns[start:start + chunk_rows])
        elif fmt in ("jsonl", "txt") or (fmt == "json" and not _looks_like_json_array(path)):
            kind = "text" if fmt == "txt" else "lines"
            with _utf8_text(path) as f:
                lines, first = [], 1
                for n, line in enumerate(f, 1):
                    if not lines:
                        first = n
                    lines.append(line)
                    if len(lines) == chunk_rows:
                        yield Chunk(name, first, kind, lines)
                        lines = []
                if lines:
                    yield Chunk(name, first, kind, lines)
        elif fmt == "json":  # one JSON array: parsed whole (use .jsonl for data that does not fit in memory)
            try:
                with _utf8_text(path) as f:
                    records = json.load(f)
            except json.JSONDecodeError as exc:
                raise PreprocessError(f"{name}: line {exc.lineno} column {exc.colno}: malformed JSON ({exc.msg})") from None
            if not isinstance(records, list):
                raise PreprocessError(f"{name}: expected a JSON array of objects, got {type(records).__name__}")
            for start in range(0, len(records), chunk_rows):
                yield Chunk(name, start + 1, "rows", records[start:start + chunk_rows])
        else:
            batches = _record_batches(path, fmt, chunk_rows)
            row, skipped = 1, []  # skipped: numbers of the malformed CSV rows the reader left out, in order
            for batch in batches:
                if isinstance(batch, list):  # malformed CSV rows the reader skipped over: (number, RowError)
                    yield Chunk(name, 0, "rows", [error for _, error in batch])
                    skipped = sorted(skipped + [number for number, _ in batch if number is not None])
                    continue
                start = 0
                while start < batch.num_rows:  # pieces of consecutive rows, numbered past the skipped ones
                    while skipped and skipped[0] <= row:
                        row += skipped.pop(0) == row
                    size = min(chunk_rows, batch.num_rows - start, skipped[0] - row if skipped else chunk_rows)
                    yield Chunk(name, row, "arrow", batch.slice(start, size))
                    row += size
                    start += size


def _record_batches(path: Path, fmt: str, chunk_rows: int):
    import pyarrow as pa

    if fmt == "parquet":
        yield from _parquet_file(path).iter_batches(batch_size=chunk_rows)
    elif fmt == "arrow":
        yield from _arrow_batches(path)
    else:  # csv: stream, every column a string so types cannot change between blocks
        import pyarrow.csv as pacsv

        header = _csv_header(path)
        if header is None:
            return  # an empty file: no rows
        # rows with the wrong number of columns: (data row number, RowError), skipped and counted, or the run stops
        invalid = []
        records = _RecordFinder(path)

        def bad_row(row) -> str:
            line, record = records.find(row.text)
            invalid.append((record, RowError(f"{path}: line {line or '?'}: {BAD_CSV}: expected {row.expected_columns} "
                                             f"columns, got {row.actual_columns}: {row.text[:80]!r}", BAD_CSV)))
            return "skip"

        try:
            reader = pacsv.open_csv(
                path,
                convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in header},
                                                     strings_can_be_null=False),
                # quoted values may span lines (answers with newlines): without this a block boundary inside one
                # splits it into bogus rows or stops the read ("out of sync with chunker")
                parse_options=pacsv.ParseOptions(invalid_row_handler=bad_row, newlines_in_values=True),
                # a quoted value must fit in one block: the whole file up to CSV_BLOCK_BYTES (pyarrow's 1 MiB
                # default stopped a file at its first value over it, "straddles two block boundaries")
                read_options=pacsv.ReadOptions(block_size=max(1 << 20, min(path.stat().st_size + 1,
                                                                             CSV_BLOCK_BYTES))),
            )
            for batch in reader:
                if invalid:
                    yield invalid[:]
                    invalid.clear()
                yield batch
            if invalid:
                yield invalid
        except pa.ArrowInvalid as exc:
            if first_undecodable_line(path) is not None:
                raise not_utf8_error(path) from None
            if "straddl" in str(exc):
                raise PreprocessError(f"{path}: a quoted CSV value is longer than {CSV_BLOCK_BYTES >> 20} MiB, the "
                                      "reader's block: store such rows as JSON lines or Parquet") from None
            raise PreprocessError(f"{path}: malformed CSV: {exc}") from None
        finally:
            records.close()


class _RecordFinder:
    """Where a CSV file's malformed rows are, which pyarrow's streaming reader does not number: the line each starts
    on and its data row number (blank lines not counted, as pyarrow skips them), found by reading the file's records
    once, alongside pyarrow, from the one after the previous row found (the rows come in file order)."""

    def __init__(self, path):
        self.file = open(path, encoding=TEXT_ENCODING, newline="")
        self.records = csv.reader(self.file)
        next(self.records, None)  # the header
        self.line, self.record = self.records.line_num, 0

    def find(self, text: str) -> tuple[Optional[int], Optional[int]]:
        fields = next(csv.reader(io.StringIO(text)), [])
        for found in self.records:
            start, self.line = self.line + 1, self.records.line_num
            if found:
                self.record += 1
                if found == fields:
                    return start, self.record
        return None, None

    def close(self) -> None:
        self.file.close()


def chunk_rows(chunk: Chunk) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for every row of a chunk; blank JSON lines are skipped."""
    if chunk.kind == "lines":
        for n, line in enumerate(chunk.payload, chunk.first):
            if line.strip():
                where = f"{chunk.file}: line {n}"
                yield where, _parse_json_line(line, where)
    elif chunk.kind == "text":
        for n, line in enumerate(chunk.payload, chunk.first):
            yield f"{chunk.file}: line {n}", {"text": line.rstrip("\r\n")}
    elif chunk.kind == "rows":
        for n, row in enumerate(chunk.payload, chunk.first):
            yield f"{chunk.file}: row {n}", row
    else:
        nested = [name for name, kind in zip(chunk.payload.schema.names, chunk.payload.schema.types) if _has_struct(kind)]
        for n, row in enumerate(chunk.payload.to_pylist(), chunk.first):
            for name in nested:
                row[name] = without_merged_keys(row[name])
            yield f"{chunk.file}: row {n}", row


def struct_objects(path, column: str) -> list[str]:
    """Where a Parquet/Arrow ``column`` stores objects of two or more keys as Arrow structs: their paths
    (``tools[].function``, ``tools[].function.parameters.properties``); [] for other formats, other
    columns and JSON text.

    A struct has one field order for the whole column (the union of every row's keys, in the order
    the writer first met them), so each row's objects come back with their keys in that order, not
    the row's own. The file does not record the order a row was written in: it cannot be restored,
    only stored as JSON text (a string column), which is read as written."""
    p = Path(path)
    fmt = FORMATS[p.suffix.lower()]
    if fmt not in ("parquet", "arrow") or p.stat().st_size == 0:
        return []
    if fmt == "parquet":
        schema = _parquet_schema(p)
    else:
        schema = _open_arrow(p).schema
    if column not in schema.names:
        return []
    return list(_struct_paths(schema.field(column).type, column))


def _struct_paths(kind, path: str):
    import pyarrow as pa

    if pa.types.is_struct(kind):
        if kind.num_fields > 1:
            yield path
        for i in range(kind.num_fields):
            yield from _struct_paths(kind.field(i).type, f"{path}.{kind.field(i).name}")
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        yield from _struct_paths(kind.value_type, f"{path}[]")
    elif pa.types.is_map(kind):
        yield from _struct_paths(kind.item_type, f"{path}{{}}")


def _has_struct(kind) -> bool:
    """Whether an Arrow type holds a struct at any depth (lists of messages, tool schemas, arguments)."""
    import pyarrow as pa

    if pa.types.is_struct(kind):
        return True
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _has_struct(kind.value_type)
    if pa.types.is_map(kind):
        return _has_struct(kind.key_type) or _has_struct(kind.item_type)
    return False


def without_merged_keys(value):
    """A nested value read from Parquet/Arrow without its null struct fields.

    An Arrow struct column has the union of every row's keys: writing ``{"city": "Paris"}`` and
    ``{"tz": "CET"}`` gives both rows ``city`` and ``tz``, null where a row had none. Read back as
    they are, tool arguments and schemas would gain keys their rows never had (``"tz": null``) and
    render differently from the same rows in JSON. A null field is therefore read as an absent
    key (an explicit ``null`` in the source cannot be told apart from it: put such data in JSON
    lines, or a JSON string column, to keep it)."""
    if isinstance(value, dict):
        return {k: without_merged_keys(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_merged_keys(v) for v in value]
    return value
