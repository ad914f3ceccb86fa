"""The columns a dataset's split files carry as data beside the inputs and targets: group ids (a user, a
site, a writer) a partitioner deals rows by and an evaluation cuts the test split by, never a model
input (the shard format's inputs are x0..., x and tokens: :mod:`shardfuse.data.shard_format`).

A source's record names its lister (:mod:`shardfuse.data.sources.registry`): the columns a spec asks
for, each with its number of groups where the spec alone tells it (None where only the data can).
The config check of a ``column`` partition reads them before any job. Standard library only: the
Snakefile imports the records. By hand::

    python -c "import shardfuse.data.sources.carried as c; print(c.digit_writers({'writers': 13}))"
"""

from __future__ import annotations

KEEP_COLUMNS = "keep_columns"  # csv, parquet: the user's columns carried as they are
WRITERS = "writers"  # digits: a writer-like id, contiguous blocks of the file's row order
WRITER_COLUMN = "writer"


def no_columns(spec: dict) -> dict[str, int | None]:
    """A source that carries nothing but its inputs and targets."""
    return {}


def kept_columns(spec: dict) -> dict[str, int | None]:
    """The user's ``keep_columns``: how many groups each holds, only the file can tell."""
    return dict.fromkeys(spec.get(KEEP_COLUMNS) or [])


DOMAIN_COLUMN = "domain"  # domains: each row's part, 0..P-1 in the order of ``parts``


def domain_parts(spec: dict) -> dict[str, int | None]:
    """A domains dataset's column ``domain``: one group per part."""
    parts = spec.get("parts")
    return {DOMAIN_COLUMN: len(parts) if isinstance(parts, list) else None}


def digit_writers(spec: dict) -> dict[str, int | None]:
    """``writers: N`` gives a column ``writer`` of N groups (0..N-1)."""
    writers = spec.get(WRITERS)
    return {WRITER_COLUMN: writers} if writers else {}
