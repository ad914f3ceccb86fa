"""Where a rank starts (the training's second phase, after :func:`shardfuse.rank.setup.set_up`): the
newest complete checkpoint every rank can read, or step 0 with the shared initial weights saved as
``base.safetensors``.
"""

from __future__ import annotations

import torch.distributed as torch_dist

from shardfuse.checkpoints.weights import save_weights
from shardfuse.io import UserError
from shardfuse.models.adapter import storable_state, ties_of
from shardfuse.models.lora import base_name, is_adapted
from shardfuse.models.lora import base_state as lora_base_state
from shardfuse.rank.checkpoint_steps import complete_steps
from shardfuse.rank.failure import record_host, record_start
from shardfuse.rank.fsdp import full_tensors
from shardfuse.rank.resume import (
    Position,
    checkpoint_problem,
    load_rank_state,
    none_readable,
    passed_over,
    resume_step,
)
from shardfuse.rank.setup import RankSetup


def resume_or_start(setup: RankSetup) -> Position:
    """Continue from the newest complete checkpoint every rank can read (model, optimiser, RNG, data
    position), or start at step 0 and save the shared initial weights as ``base.safetensors``."""
    model, checkpoint_dir = setup.model, setup.checkpoint_dir
    step = agreed_resume_step(setup)
    setup.gate.call(record_start, setup.out_dir, step or 0)  # for the launcher (shardfuse.rank.loss)
    record_host(setup.out_dir, setup.member_rank)  # every rank: the node a lost node takes it with
    if step is None:
        base_meta = {key: value for key, value in setup.meta.items() if key != "adapter"}
        base_meta["rank"] = None
        if is_adapted(model):  # the frozen weights under the model's own names
            ties = ties_of(model)
            base = lora_base_state(model, ties)
            if ties:
                base_meta["ties"] = {base_name(alias): base_name(source) for alias, source in ties.items()}
        elif setup.sharded:  # whole again, one tensor at a time, onto rank 0
            base_meta.pop("fsdp", None)
            base = full_tensors(setup.model_state(), keep=setup.ctx.rank == 0)
        else:
            base = storable_state(model)[0]
        setup.gate.call(save_weights, setup.out_dir / "base.safetensors", base, base_meta)
        return Position()
    position = load_rank_state(
        checkpoint_dir,
        step,
        setup.member_rank,
        model,
        setup.optimizer,
        expect=setup.identity,
        sharded=setup.model_state() if setup.sharded else None,
    )
    setup.gate.log(
        f"[{setup.run}] resuming from checkpoint step {position.step} (epoch {position.epoch + 1}, "
        f"batch {position.next_batch})"
    )
    return position


def agreed_resume_step(setup: RankSetup) -> int | None:
    """The step every rank resumes from: the newest complete checkpoint that all ranks can read, each
    newer one passed over with a warning (a file truncated by a full disk); None to start afresh.
    Rank 0 lists the checkpoints and every rank takes its list: ranks that looked at the directory at
    different moments (a checkpoint completing in between) would otherwise resume out of step."""
    listed = [complete_steps(setup.checkpoint_dir) if setup.ctx.rank == 0 else None]
    torch_dist.broadcast_object_list(listed, src=0)
    steps = listed[0]
    if not steps:
        return None
    own = {
        step: problem
        for step in steps
        if (problem := checkpoint_problem(setup.checkpoint_dir, step, setup.member_rank)) is not None
    }
    problems: list[dict[int, str]] = [{} for _ in range(setup.ctx.world_size)]
    torch_dist.all_gather_object(problems, own)
    step, skipped = resume_step(steps, problems)
    if step is None:
        raise UserError(none_readable(setup.checkpoint_dir, skipped))
    for skipped_step, problem in skipped:
        setup.gate.log(passed_over(skipped_step, problem, step))
    return step
