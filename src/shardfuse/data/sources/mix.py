"""A domains dataset's ``mix_weights``, checked before any job (torch- and numpy-free: the config loader
reads it through the source's record). The mix itself is drawn where the union is written
(:mod:`shardfuse.data.sources.domains`). By hand::

    python -c "from shardfuse.data.sources.mix import mix_weights_problem
    print(mix_weights_problem({'parts': ['a', 'b'], 'mix_weights': [1, -1]}))"
"""

from __future__ import annotations

import math
from typing import Any

MIX_WEIGHTS = "mix_weights"


def _is_weight(value: Any) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value >= 0


def mix_weights_problem(spec: dict[str, Any]) -> tuple[str, str] | None:
    """(key, message) when ``mix_weights`` is not one finite weight >= 0 per part, not all 0."""
    weights, parts = spec.get(MIX_WEIGHTS), spec.get("parts")
    if weights is None or not isinstance(parts, list):
        return None
    numbers = isinstance(weights, list) and all(_is_weight(w) for w in weights)
    if numbers and len(weights) == len(parts) and sum(weights) > 0:
        return None
    return (
        MIX_WEIGHTS,
        f"give one finite weight >= 0 per part ({len(parts)}: {', '.join(map(str, parts))}), not all 0, "
        f"got {weights!r}",
    )
