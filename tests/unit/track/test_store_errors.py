"""A store's own filesystem errors are one line naming the store and the fix for that filesystem (a
read-only store, a full mlruns/), never the results' "free space" hint or a temporary file's name."""

from __future__ import annotations

import errno
import os

import pytest

from shardfuse.io import UserError
from shardfuse.track.client import tracking_errors

URI = "sqlite:////data/team/mlflow.db"


def raised_in_store(exc: BaseException) -> str:
    with pytest.raises(UserError) as caught, tracking_errors(URI):
        raise exc
    return str(caught.value)


def test_a_read_only_store_says_read_only_and_names_the_store():
    path = "/data/team/mlruns/1/abc/artifacts/.loss.png.tmp-x1y2z3"
    message = raised_in_store(OSError(errno.EROFS, os.strerror(errno.EROFS), path))
    assert message.startswith(f"cannot use tracking URI {URI} (Read-only file system: ")
    assert "/data/team/mlruns/1/abc/artifacts/loss.png" in message and ".tmp-" not in message
    assert "the store is read-only or not writable" in message and "free space" not in message


def test_a_full_mlruns_says_free_space_on_the_stores_filesystem():
    message = raised_in_store(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/team/mlruns/1/x"))
    assert "No space left on device" in message
    assert "free space on the store's filesystem or point mlflow.tracking_uri at another" in message


def test_a_permission_error_in_the_store_is_not_a_disk_space_problem():
    message = raised_in_store(
        PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/data/team/mlflow.db")
    )
    assert "Permission denied: /data/team/mlflow.db" in message and "not writable" in message


def test_a_bug_inside_the_store_block_keeps_its_traceback():
    with pytest.raises(ZeroDivisionError), tracking_errors(URI):
        raise ZeroDivisionError("a bug")


def test_a_value_mlflow_refuses_is_not_blamed_on_the_server(tmp_path):
    """A real store refusing a logged model's name with a '.' answered "start the server or fix
    mlflow.tracking_uri": the store was fine. Its refusal of a value says so, and names the value."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("names")
    with pytest.raises(UserError) as caught, tracking_errors(uri):
        client.create_logged_model(experiment, name="ties_d0.1_s0.5")
    message = str(caught.value)
    assert "Invalid model name ('ties_d0.1_s0.5')" in message
    assert "the store is up and refused a value shardfuse sent it; fix the value it names" in message
    assert "start the server" not in message
