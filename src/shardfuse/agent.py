"""torchrun with the ranks forked from its agent: ``python -m shardfuse.agent`` takes torchrun's command
line and runs torchrun's launcher, each rank a fork of the agent that imported the training code once
(:mod:`shardfuse.cluster.agent`; ``SHARDFUSE_RANK_START=spawn`` starts fresh interpreters, as torchrun
does). The launch stage runs it; by hand::

    python -m shardfuse.agent --standalone --nnodes=1 --nproc-per-node=2 -m shardfuse.train --run-name ...
"""

from __future__ import annotations

from shardfuse.cluster.agent import run_agent

main = run_agent

if __name__ == "__main__":
    main()
