"""SHARDFUSE_OWNER_WAIT (how long a launch waits for a training's previous owner) is a finite number of
seconds; a bad value is one line naming the variable, never a wait for ever or a traceback (issue 54)."""

from __future__ import annotations

import pytest

from shardfuse.cluster.ownership import OWNER_WAIT_ENV, owner_wait_seconds
from shardfuse.io import UserError


@pytest.mark.parametrize(("text", "seconds"), [(None, 60.0), ("0", 0.0), ("600", 600.0), ("2.5", 2.5)])
def test_a_number_of_seconds_is_read(text, seconds):
    environ = {} if text is None else {OWNER_WAIT_ENV: text}
    assert owner_wait_seconds(environ) == seconds


@pytest.mark.parametrize("text", ["nan", "inf", "-1", "soon", "", "1e9"])
def test_anything_else_is_one_line_naming_the_variable(text):
    with pytest.raises(
        UserError, match=r"^SHARDFUSE_OWNER_WAIT='.*' is not a number of seconds from 0 to 604800"
    ):
        owner_wait_seconds({OWNER_WAIT_ENV: text})
