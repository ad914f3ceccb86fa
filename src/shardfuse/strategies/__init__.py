"""Training strategies: how the ranks (replicas, under fsdp) of a training keep in touch.

``registry`` holds one torch-free record per strategy, read by the config layer and the train stage
alike; each strategy's hook (a ``Sync``) lives in its own module, imported only when a training builds
it. A library package: it imports neither a stage nor ``rank`` or ``experiment`` (which import it).
This file stays a docstring (no imports).
"""
