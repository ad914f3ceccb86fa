"""The partition stage's two passes as a partitioner sees them (:mod:`.assignment` is the contract): the
counting pass over the columns it declares, and each read batch's ranks from its deal, checked.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardfuse.data.partitioners.assignment import LABEL_COLUMN, Deal, Scan, ValueCounts
from shardfuse.data.partitioners.dealing import ValueIndex
from shardfuse.data.shard_format import column_values, read_batches
from shardfuse.io import UserError


def check_columns(name: str, columns: Sequence[str], schema: pa.Schema, what: str, fix: str) -> None:
    """Every column the partitioner reads is in the input: else one line naming the column."""
    missing = [column for column in columns if column not in schema.names]
    if missing:
        raise UserError(
            f"partitioner {name} reads column {missing[0]!r}, which {what} does not have (it has "
            f"{', '.join(schema.names)}); name another column in the partition keys, or {fix}"
        )


def check_counted(name: str, columns: Sequence[str], schema: pa.Schema) -> None:
    """A counted column holds discrete values: a float column's counts would be as large as the data."""
    for column in columns:
        column_type = schema.field(column).type
        if pa.types.is_floating(column_type):
            raise UserError(
                f"partitioner {name} groups rows by the values of column {column!r}, which holds "
                f"floating-point numbers ({column_type}); name a column of integers or strings "
                "(partition: continuous splits by a float column)"
            )


def shown_columns(batch: pa.RecordBatch, columns: Sequence[str]) -> dict[str, np.ndarray]:
    """The batch's ``columns`` as NumPy: numeric ones without nulls as views (Arrow's own to_numpy
    imports pandas, a start-up cost per process), others (strings, nulls: NaN or None) converted."""
    shown = {}
    for column in columns:
        values = batch.column(column)
        numeric = pa.types.is_integer(values.type) or pa.types.is_floating(values.type)
        shown[column] = (
            column_values(values)
            if numeric and not values.null_count
            else values.to_numpy(zero_copy_only=False)
        )
    return shown


def scanner(
    parquet_file: pq.ParquetFile, columns: Sequence[str], what: str, fix: str, batch_size: int
) -> Scan:
    """A fresh pass over ``columns`` each call (for a deal that needs more than value counts)."""

    def scan() -> Iterator[Mapping[str, np.ndarray]]:
        batches = read_batches(parquet_file, what, fix, batch_size=batch_size, columns=list(columns))
        return (shown_columns(batch, columns) for batch in batches)

    return scan


def count_values(
    parquet_file: pq.ParquetFile, columns: Sequence[str], what: str, fix: str, batch_size: int
) -> dict[str, ValueCounts]:
    """The counting pass: for each of ``columns``, the rows holding each value (in value order, a null
    last), read one batch of those columns at a time (memory: the distinct values, not the rows)."""
    counts: dict[str, ValueCounts] = {column: {} for column in columns}
    if not columns:
        return counts
    for batch in read_batches(parquet_file, what, fix, batch_size=batch_size, columns=list(columns)):
        for column in columns:
            found = counts[column]
            for item in pc.value_counts(batch.column(column)).to_pylist():
                found[item["values"]] = found.get(item["values"], 0) + item["counts"]
    return {
        column: dict(sorted(found.items(), key=lambda item: (item[0] is None, item[0])))
        for column, found in counts.items()
    }


def dealt_ranks(
    name: str, deal: Deal, columns: Sequence[str], world_size: int, batch: pa.RecordBatch
) -> np.ndarray:
    """The ranks ``deal`` gives the rows of ``batch`` (shown its declared columns), checked: one integer
    in 0..world_size per row (a deal that breaks its contract is a bug in the partitioner, not bad input)."""
    ranks = np.asarray(deal(batch.num_rows, shown_columns(batch, columns)))
    if ranks.shape != (batch.num_rows,) or not np.issubdtype(ranks.dtype, np.integer):
        raise ValueError(
            f"partitioner {name} dealt {ranks.dtype} ranks of shape {ranks.shape} to a batch of "
            f"{batch.num_rows} rows; a deal returns one integer rank per row"
        )
    if len(ranks) and (int(ranks.min()) < 0 or int(ranks.max()) > world_size):
        raise ValueError(
            f"partitioner {name} dealt ranks {int(ranks.min())}..{int(ranks.max())}; a deal returns "
            f"0..{world_size - 1} ({world_size}: the row is dropped)"
        )
    # bincount and comparisons want a platform integer; iid's uint8 (one byte per row) already is one.
    return ranks if np.can_cast(ranks.dtype, np.intp) else ranks.astype(np.intp)


class RankValueTally:
    """Rows of each value of the counted columns but the label (which the shard writers count) per
    rank, batch by batch: the group values and rows the manifest records for each rank. Memory: the
    values (from the counting pass) x the ranks."""

    def __init__(self, counts: Mapping[str, ValueCounts], world_size: int) -> None:
        self.width = world_size + 1
        self.values = {column: list(found) for column, found in counts.items() if column != LABEL_COLUMN}
        self.index = {column: ValueIndex(values) for column, values in self.values.items()}
        self.tables = {
            column: np.zeros(len(values) * self.width, dtype=np.int64)
            for column, values in self.values.items()
        }

    @property
    def columns(self) -> list[str]:
        return list(self.values)

    def add(self, batch: pa.RecordBatch, ranks: np.ndarray) -> None:
        for column, index in self.index.items():
            rows_value = index.of(shown_columns(batch, [column])[column])
            self.tables[column] += np.bincount(
                rows_value * self.width + ranks, minlength=len(self.tables[column])
            )

    def of_rank(self, rank: int) -> dict[str, dict[str, int]]:
        """{column: {value: rows}} of one rank, in value order, values it has none of left out."""
        found = {}
        for column, values in self.values.items():
            rows = self.tables[column].reshape(-1, self.width)[:, rank]
            found[column] = {str(value): int(n) for value, n in zip(values, rows.tolist(), strict=True) if n}
        return found
