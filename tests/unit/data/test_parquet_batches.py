"""A Parquet row group is decoded a bounded amount of data at a time (data/readers.py `PARQUET_BATCH_BYTES`): 1024
rows a batch held 800 KB rows at 4.9 GB of RSS, and > 2 GB of strings in one nested batch is an Arrow error
(apache/arrow#21526, #32723), which came out as a traceback."""

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import readers
from data.discover import Unit
from data.readers import Fields, iter_rows


def _write(path, rows: int, kb: int) -> Unit:
    rng = random.Random(0)
    base = "".join(rng.choice("abcdefgh ijklmnop") for _ in range(kb << 10))  # distinct rows: no dictionary
    msgs = [[{"role": "user", "content": base[i:] + base[:i]}, {"role": "assistant", "content": "ok"}]
            for i in range(rows)]
    pq.write_table(pa.table({"messages": msgs}), path)  # one row group
    return Unit("big", "parquet", str(path))


def test_a_row_group_of_large_rows_is_decoded_in_batches_sized_by_its_bytes(tmp_path, monkeypatch):
    unit = _write(tmp_path / "big.parquet", rows=10, kb=300)  # ~3 MB in one row group
    monkeypatch.setattr(readers, "PARQUET_BATCH_BYTES", 1 << 20, raising=False)  # ~3 rows of 300 KB a batch
    sizes, real = [], pq.ParquetFile.iter_batches

    def counted(self, *a, **kw):
        for batch in real(self, *a, **kw):
            sizes.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counted)
    rows = [r for r, _ in iter_rows(unit, Fields())]
    assert rows == list(range(10)) and sum(sizes) == 10
    assert max(sizes) <= 4, sizes  # before: every row in one batch of up to 1024
    assert [r for r, _ in iter_rows(unit, Fields(), start=7)] == [7, 8, 9]  # resume inside the row group


@pytest.mark.parametrize("error", [pa.ArrowCapacityError, pa.ArrowNotImplementedError])
def test_a_batch_arrow_cannot_decode_is_one_line_naming_smaller_row_groups(tmp_path, monkeypatch, error):
    unit = _write(tmp_path / "big.parquet", rows=2, kb=1)

    def refuse(self, *a, **kw):
        raise error("Nested data conversions not implemented for chunked array outputs")
        yield

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", refuse)
    with pytest.raises(ValueError, match="row group 0 .*smaller row groups") as e:
        list(iter_rows(unit, Fields()))
    assert "\n" not in str(e.value)
