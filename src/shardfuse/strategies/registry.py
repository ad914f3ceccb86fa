"""Every training strategy, one record each: how its ranks keep in touch (its ``Sync``, built when a
training starts), what it asks of the config (``sync_every``, the keys only it reads, whether its ranks
may start apart), whether its ranks publish the same weights, what the rank set-up wraps around the
model for it (DDP; HSDP under fsdp), and how train.json and the figures name and colour it.

Torch-free and import-light: the config loader (the Snakefile) reads these records as the train stage
does, so the two cannot disagree; a record imports its ``Sync`` module (and torch) only when a training
builds it. Records are looked up by name at call time (``RECORDS`` read when called), so a test can
extend ``RECORDS`` and every stage sees the new strategy. The config schema's ``strategy`` enum is held
equal to ``RECORDS`` by tests/contracts/test_registries.py.

Adding a strategy: its ``Sync`` subclass in a module of this package (:mod:`shardfuse.strategies.sync`
says what the hook is told) and one record here; then its name in the schema's ``strategy`` enum and
its row in config/README.md. By hand::

    python -c "from shardfuse.strategies.registry import find_strategy; \\
        print(find_strategy('localsgd').mode(0), find_strategy('diloco').identity_keys)"
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from shardfuse.cluster.membership import ORPHANS, RESHARD
from shardfuse.io import find_record

# How a strategy reads sync_every: UNUSED, it must stay 0 (the strategy keeps its own cadence); OPTIONAL,
# 0 means never; REQUIRED, at least 1.
UNUSED, OPTIONAL, REQUIRED = "unused", "optional", "required"

# Whether its ranks publish the same weights (merge_method consolidate checks and takes one of them).
ALWAYS, UNLESS_KEEP_BEST, NEVER = "always", "unless keep best", "never"

# The run keys every strategy choice sets; a record adds the keys only it reads. Together they are what
# a run's ddp baseline may differ in (shardfuse.experiment.load.Experiment.ddp_baseline).
CHOICE_KEYS = ("strategy", "sync_every", "init")

# sync_every as the runs table (strings) or an older train.json (absent) may give it: never.
NEVER_SYNCS = (0, "0", "", None)


class SyncSettings(Protocol):
    """What a strategy's hook reads of the run (shardfuse.experiment.run_config.SyncConfig is one; a
    strategy with keys of its own reads them in its ``Sync.from_settings``)."""

    @property
    def strategy(self) -> str: ...

    @property
    def sync_every(self) -> int: ...


@dataclass(frozen=True)
class Strategy:
    name: str
    sync: Callable[[], type]  # its Sync subclass, imported (with torch) only when a training builds it
    reference: str
    color: str  # its points in the communication figure (shardfuse.report.figures)
    sync_every: str = OPTIONAL  # UNUSED | OPTIONAL | REQUIRED
    sync_every_note: str = ""  # the parenthesis of its sync_every error: why unused, or what it counts
    apart: tuple[str, str] | None = None  # (mode, colour) of sync_every 0: localsgd's "independent"
    own_keys: tuple[str, ...] = ()  # run keys only it reads: refused off their defaults with the others
    own_keys_why: str = ""  # what such a key is, "... but strategy is {strategy}", the run's
    equal_start: str | None = None  # why its ranks must start alike (init per_rank refused); None: may not
    identical_ranks: str = NEVER  # ALWAYS | UNLESS_KEEP_BEST | NEVER
    reduces_gradients: bool = False  # DDP around the model (HSDP under fsdp): gradients all-reduced
    baseline: bool = False  # the synchronous reference: a run's ddp baseline is trained with it
    # The others can go on without a rank lost for good (min_ranks below world_size; shardfuse.rank.loss).
    survives_rank_loss: bool = False
    # ... but only with the lost rank's rows dealt to them (orphans: reshard): its ranks train one model
    # on one global batch (ddp: elastic data parallel), so a shard left unseen would change the batch.
    needs_every_row: bool = False

    def mode(self, sync_every: Any) -> str:
        """train.json's and the summary's mode: the name, or the ``apart`` mode when it never syncs."""
        return self.apart[0] if self.apart is not None and sync_every in NEVER_SYNCS else self.name

    def runs_apart(self, sync_every: Any) -> bool:
        """Whether its ranks never meet while they train (no gradient reduction, no sync), so they may
        take different numbers of steps (epoch_steps: own)."""
        return self.apart is not None and sync_every in NEVER_SYNCS and not self.reduces_gradients

    def colors(self) -> dict[str, str]:
        return {self.name: self.color, **({self.apart[0]: self.apart[1]} if self.apart else {})}

    @property
    def identity_keys(self) -> tuple[str, ...]:
        """The training-identity keys this strategy choice sets."""
        return (*CHOICE_KEYS, *self.own_keys)

    def publishes_identical(self, keep: str) -> bool:
        return self.identical_ranks == ALWAYS or (self.identical_ranks == UNLESS_KEEP_BEST and keep != "best")

    def sync_every_problem(self, sync_every: int) -> str | None:
        """``sync_every: ...`` when the run's sync_every does not fit this strategy, else None."""
        if self.sync_every == UNUSED and sync_every != 0:
            users = [record.name for record in RECORDS if record.sync_every != UNUSED]
            return (
                f"sync_every: only {listing(users, 'and')} sync every N steps ({self.sync_every_note}); "
                f"remove sync_every or set strategy {listing(users, 'or')}"
            )
        if self.sync_every == REQUIRED and sync_every == 0:
            return (
                f"sync_every: strategy {self.name} needs sync_every >= 1 ({self.sync_every_note}); "
                "set sync_every"
            )
        return None

    def build(self, model: Any, world_size: int, settings: SyncSettings, group: Any = None) -> Any:
        """Its Sync for ``model`` over ``world_size`` ranks in ``group`` (None: the whole world)."""
        return self.sync().from_settings(model, world_size, settings, group)


def _ddp() -> type:
    from shardfuse.strategies.ddp import DDPSync

    return DDPSync


def _localsgd() -> type:
    from shardfuse.strategies.localsgd import LocalSGD

    return LocalSGD


def _diloco() -> type:
    from shardfuse.strategies.diloco import DiLoCo

    return DiLoCo


RECORDS: tuple[Strategy, ...] = (
    Strategy(
        "ddp",
        _ddp,
        "Li et al. 2020, PyTorch Distributed (DistributedDataParallel)",
        color="#1f77b4",
        sync_every=UNUSED,
        sync_every_note="ddp syncs gradients every step",
        own_keys=("find_unused_parameters", "static_graph"),
        own_keys_why=(
            "a DistributedDataParallel setting but strategy is {strategy}, which keeps no DDP wrapper"
        ),
        equal_start="ddp starts every rank from rank 0's weights",
        identical_ranks=ALWAYS,
        reduces_gradients=True,
        baseline=True,
        survives_rank_loss=True,
        needs_every_row=True,
    ),
    Strategy(
        "localsgd",
        _localsgd,
        "Lin et al. 2020, Don't use large mini-batches, use local SGD",
        color="#ff7f0e",
        apart=("independent", "#2ca02c"),
        survives_rank_loss=True,
    ),
    Strategy(
        "diloco",
        _diloco,
        "Douillard et al. 2023, DiLoCo",
        color="#9467bd",
        sync_every=REQUIRED,
        sync_every_note="the inner steps between outer steps, e.g. 16",
        own_keys=("outer_lr", "outer_momentum"),
        own_keys_why="only strategy diloco has an outer optimiser but strategy is {strategy}",
        equal_start="diloco's outer step needs one shared starting point",
        identical_ranks=UNLESS_KEEP_BEST,
        survives_rank_loss=True,
    ),
)


def listing(names: list[str], word: str) -> str:
    """``a``, ``a and b``, ``a, b and c`` (``word``: and, or)."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {word} {names[-1]}"


def names() -> tuple[str, ...]:
    """Every strategy's name: the schema's ``strategy`` enum."""
    return tuple(record.name for record in RECORDS)


def find_strategy(name: str) -> Strategy:
    """The record of a configured strategy; an unknown name is a one-line UserError listing the known."""
    return find_record(RECORDS, name, "strategy")


def recorded_strategy(name: Any) -> Strategy | None:
    """The record of a strategy a file names (train.json, gather.json), or None where this version does
    not know it (a newer stage's, or a test's toy)."""
    return next((record for record in RECORDS if record.name == name), None)


def mode_of(strategy: str, sync_every: Any) -> str:
    """The training mode (ddp, localsgd, independent, diloco, ...); a strategy this version does not know
    is its own mode. ``sync_every`` may come from a runs table cell (a string) or be absent."""
    record = recorded_strategy(strategy)
    return strategy if record is None else record.mode(sync_every)


def mode_colors() -> dict[str, str]:
    """Mode -> its colour in the figures."""
    return {mode: color for record in RECORDS for mode, color in record.colors().items()}


def identity_keys() -> tuple[str, ...]:
    """The training-identity keys a strategy choice sets (what a run's ddp baseline may differ in)."""
    return tuple(dict.fromkeys(key for record in RECORDS for key in record.identity_keys))


def own_keys_problem(strategy: str, run: Mapping[str, Any], defaults: Mapping[str, Any]) -> str | None:
    """``key: ...`` for a key only another strategy reads, set off its default (it would name a new
    training for the same training), else None."""
    for record in RECORDS:
        if record.name == strategy:
            continue
        for key in record.own_keys:
            if run.get(key, defaults[key]) != defaults[key]:
                return (
                    f"{key}: {record.own_keys_why.format(strategy=strategy)}; remove {key} or set strategy "
                    f"{record.name}"
                )
    return None


def apart_starters() -> str:
    """The strategies whose ranks may start from their own weights, for an error's fix."""
    return listing([record.name for record in RECORDS if record.equal_start is None], "or")


def apart_runs() -> str:
    """The strategy settings whose ranks never meet while training, for an error's fix."""
    return listing([f"{record.name} with sync_every 0" for record in RECORDS if record.apart], "or")


def identical_publishers() -> str:
    """Which strategies publish identical ranks, for consolidate's error."""
    always = [record.name for record in RECORDS if record.identical_ranks == ALWAYS]
    unless = [record.name for record in RECORDS if record.identical_ranks == UNLESS_KEEP_BEST]
    parts = [f"strategy {listing(always, 'or')}"] if always else []
    return ", or ".join(parts + [f"{name} keeping its last weights" for name in unless])


def make_sync(model: Any, world_size: int, settings: SyncSettings, mesh: Any = None) -> Any:
    """The run's strategy hook; with an fsdp ``mesh``, across its replicas (the ``replicate`` group)."""
    group = None
    if mesh is not None:
        group, world_size = mesh["replicate"].get_group(), mesh["replicate"].size()
    return find_strategy(settings.strategy).build(model, world_size, settings, group)


def rank_loss_problem(
    min_ranks: int | None,
    world_size: int,
    strategy: str,
    fsdp: int,
    nodes: int,
    orphans: str = ORPHANS[0],
    unaligned: str | None = None,
) -> str | None:
    """Why ``min_ranks`` (the fewest ranks a training goes on with after one is lost for good) and
    ``orphans`` (what becomes of the lost rank's shard: ``drop`` leaves it unseen, ``reshard`` deals its
    rows to the others) cannot be used with this training; None when they can, or min_ranks is the world
    size (every rank needed). ``unaligned``: the run's epoch_steps when it gives the ranks different
    micro-batches per epoch (shardfuse.data.epoch_steps), which dealing a lost rank's cannot follow."""
    if min_ranks is None or min_ranks == world_size:
        if orphans == RESHARD:
            return (
                f"orphans: {orphans} deals a lost rank's rows to the others, but min_ranks is the world size "
                f"{world_size}, so no rank may be lost; set min_ranks below {world_size}, or remove orphans"
            )
        return None
    if not 1 <= min_ranks <= world_size:
        return f"min_ranks {min_ranks} must be from 1 to world_size {world_size}"
    record = find_strategy(strategy)
    if not record.survives_rank_loss:
        survivors = listing([r.name for r in RECORDS if r.survives_rank_loss], "or")
        return (
            f"min_ranks {min_ranks} lets the others go on without a lost rank, but strategy {strategy} needs "
            f"every rank at every step; use {survivors}, or set min_ranks to {world_size}"
        )
    if record.needs_every_row and orphans != RESHARD:
        return (
            f"min_ranks {min_ranks} with strategy {strategy} and orphans {orphans}: its ranks train one "
            f"model on one global batch, so the others go on only with the lost rank's rows dealt to them; "
            f"set orphans: {RESHARD}, or min_ranks to {world_size}"
        )
    if orphans == RESHARD and unaligned is not None:
        return (
            f"orphans: {orphans} deals each of the lost rank's micro-batches to the others as they take "
            f"theirs, but epoch_steps {unaligned} gives the ranks different micro-batches per epoch; set "
            f"an epoch_steps that keeps them in step, or orphans: {ORPHANS[0]}"
        )
    if fsdp > 1:
        return (
            f"min_ranks {min_ranks} with fsdp {fsdp}: a replica that loses a rank loses that rank's slice of "
            f"its model, and replica loss is not built yet; set fsdp: 1 or min_ranks to {world_size}"
        )
    per_node = world_size // max(nodes, 1)
    if nodes > 1 and min_ranks > world_size - per_node:
        return (
            f"min_ranks {min_ranks} with nodes {nodes}: on several nodes the unit of loss is a node, which "
            f"takes its {per_node} rank(s) with it, so min_ranks {min_ranks} lets no node go; set min_ranks "
            f"to at most {world_size - per_node}, or to {world_size}"
        )
    return None
