"""One owner per training: the launcher's lock on a training's staging directory, the watch that ends a
local training when the ``snakemake`` that started it dies, and the record of a published training.

A library module for :mod:`shardfuse.launch` (no torch). Three guarantees:

* **One owner.** The launcher holds an exclusive POSIX lock (``fcntl.lockf``: NFS-safe through the lock
  daemon) on ``results/trainings/<training>/.ranks.lock`` for as long as it runs, and writes the owner
  record beside it (``.ranks.owner.json``: host, pid, start time, SLURM job id). The OS drops the lock
  when the owner dies, however it dies, so a dead owner's record is simply taken over. A second
  launch waits up to ``SHARDFUSE_OWNER_WAIT`` seconds (default 60: an owner that is shutting down, such
  as the orphan of a killed ``snakemake``, is gone within a few seconds) and then refuses in one line
  that names the owner and how to stop it. Where the filesystem has no locks, the record alone decides
  (a local pid that no longer runs, or a SLURM job that ``squeue`` no longer lists, is dead).
* **No orphans.** A local launch (not inside a SLURM job, where the job outlives a killed ``snakemake``
  by design) watches the ``snakemake`` process among its ancestors; when it dies, the training's
  process group (torchrun and every rank) is terminated. torchrun runs in its own process group with a
  parent-death signal, so it also ends if the launcher itself is killed.
* **Published is kept.** The published ``ranks/`` directory carries ``launch.json`` (the launch's
  identity: arguments and the digests of its shard manifest, dataset record and init weights), and a
  hard-linked copy stays in ``.ranks.published/``. A later launch of the same identity, when Snakemake
  has deleted ``ranks/`` (``--rerun-incomplete`` after a killed workflow whose job finished anyway),
  restores it instead of training again: the same config and data give the same weights.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from shardfuse.io import OutputFolder, UserError, replace_dir, write_json

# A training's published folder (launch --out-dir, collect --out-dir): its train.json says it is one.
TRAINING_FOLDER = OutputFolder("a training (train or collect)", "--out-dir", "train.json", "strategy")

OWNER_WAIT_ENV = "SHARDFUSE_OWNER_WAIT"
PR_SET_PDEATHSIG = 1


def lock_path(out_dir: Path) -> Path:
    return out_dir.with_name(f".{out_dir.name}.lock")


def owner_path(out_dir: Path) -> Path:
    return out_dir.with_name(f".{out_dir.name}.owner.json")


def published_copy(out_dir: Path) -> Path:
    return out_dir.with_name(f".{out_dir.name}.published")


def _owner_record() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }


def _describe(record: dict[str, Any]) -> str:
    where = f"pid {record.get('pid')} on {record.get('host')} since {record.get('started')}"
    job = record.get("slurm_job_id")
    if job:
        return f"SLURM job {job} ({where}); stop it with `scancel {job}`"
    return f"{where}; stop it with `kill {record.get('pid')}` on {record.get('host')}"


def _record_alive(record: dict[str, Any]) -> bool:
    """For filesystems without locks: whether the recorded owner still runs (as far as we can tell)."""
    job = record.get("slurm_job_id")
    if job and shutil.which("squeue"):
        listed = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True)
        return listed.returncode == 0 and bool(listed.stdout.strip())
    if record.get("host") != socket.gethostname():
        return True  # another machine's process: cannot tell, assume it runs
    try:
        os.kill(int(record.get("pid", 0)), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


MAX_OWNER_WAIT = 7 * 24 * 3600.0  # a week: the longest a launch waits for the training's owner


def owner_wait_seconds(environ: dict[str, str] | os._Environ) -> float:
    """``$SHARDFUSE_OWNER_WAIT`` (default 60) as seconds: a finite number from 0 to a week; anything
    else (``nan``, ``inf``, ``soon``) is one line naming the variable, never a wait for ever."""
    text = environ.get(OWNER_WAIT_ENV, "60")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_OWNER_WAIT:  # NaN fails every comparison
        raise UserError(
            f"{OWNER_WAIT_ENV}={text!r} is not a number of seconds from 0 to {MAX_OWNER_WAIT:.0f}; set it "
            "to how long a launch waits for the training's previous owner (e.g. 60), or unset it"
        )
    return value


@contextlib.contextmanager
def own_training(out_dir: Path, wait_seconds: float | None = None) -> Iterator[dict[str, Any]]:
    """Hold the training's lock for the block (waiting for a previous owner up to ``wait_seconds``,
    default ``$SHARDFUSE_OWNER_WAIT`` or 60); refuse in one line if it is still held then."""
    if wait_seconds is None:
        wait_seconds = owner_wait_seconds(os.environ)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path(out_dir), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, announced, locked = time.monotonic() + wait_seconds, False, True
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    locked = False  # no locks here: the record decides
                    _check_record(out_dir)
                    break
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
            record = _read_record(out_dir)
            if time.monotonic() >= deadline:
                raise UserError(
                    f"training {out_dir.parent.name} is already running: {_describe(record)}; or wait "
                    f"for it to finish, then re-run (a finished training is reused, not retrained)"
                )
            if not announced:
                print(
                    f"launch: waiting up to {wait_seconds:.0f} s for the current owner of "
                    f"{out_dir.parent.name} to finish: {_describe(record)}",
                    flush=True,
                )
                announced = True
            time.sleep(0.5)
        record = _owner_record()
        write_json(owner_path(out_dir), {**record, "os_lock": locked})
        yield record
    finally:
        with contextlib.suppress(OSError):
            current = _read_record(out_dir)
            if current.get("pid") == os.getpid() and current.get("host") == socket.gethostname():
                owner_path(out_dir).unlink()
        os.close(fd)  # releases the lock


def _read_record(out_dir: Path) -> dict[str, Any]:
    try:
        return json.loads(owner_path(out_dir).read_text())
    except (OSError, ValueError):
        return {"pid": "?", "host": "?", "started": "?"}


def _check_record(out_dir: Path) -> None:
    if owner_path(out_dir).is_file():
        record = _read_record(out_dir)
        if _record_alive(record) and record.get("pid") != os.getpid():
            raise UserError(f"training {out_dir.parent.name} is already running: {_describe(record)}")


# ------------------------------------------------------------------ no orphans


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def snakemake_ancestor() -> tuple[int, str] | None:
    """The nearest ancestor process running snakemake (pid, start time), if any."""
    pid = os.getppid()
    while pid and pid > 1:
        if "snakemake" in _cmdline(pid):
            start = _start_time(pid)
            return (pid, start) if start is not None else None
        pid = _parent_of(pid) or 0
    return None


def _alive(pid: int, start: str) -> bool:
    return _start_time(pid) == start  # a recycled pid has another start time


def watch_ancestor(
    ancestor: tuple[int, str], proc: subprocess.Popen, interval: float = 0.5
) -> threading.Thread:
    """Terminate ``proc``'s process group (SIGTERM, then SIGKILL after 15 s) once ``ancestor`` is gone."""

    def watch() -> None:
        while proc.poll() is None:
            if not _alive(*ancestor):
                print(
                    f"launch: snakemake (pid {ancestor[0]}) is gone; stopping the training (a re-run "
                    "resumes from its newest checkpoint)",
                    flush=True,
                )
                terminate_group(proc)
                return
            time.sleep(interval)

    thread = threading.Thread(target=watch, name="snakemake-watch", daemon=True)
    thread.start()
    return thread


def terminate_group(proc: subprocess.Popen, grace: float = 15.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # ranks that outlived torchrun


def own_group_with_parent_death_signal() -> None:
    """``preexec_fn`` for torchrun: its own process group (so the launcher can end it and its ranks
    together) and SIGTERM when the launcher dies (so a killed launcher leaves no training behind)."""
    os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# ------------------------------------------------------------------ published is kept


def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def launch_identity(train_args: list[str]) -> dict[str, Any]:
    """What makes two launches the same training: the arguments, and the digests of what they name
    (shard manifest, dataset record, init weights), so re-made data is never mistaken for the old."""

    def value_of(flag: str) -> str | None:
        return train_args[train_args.index(flag) + 1] if flag in train_args[:-1] else None

    inputs = {}
    for flag, name in (("--shard-dir", "manifest.json"), ("--dataset-dir", "dataset.json")):
        if value_of(flag):
            inputs[flag] = _sha256(Path(value_of(flag)) / name)
    if value_of("--init-from"):
        inputs["--init-from"] = _sha256(Path(value_of("--init-from")))
    return {"train_args": train_args, "inputs": inputs}


def keep_published(out_dir: Path, identity: dict[str, Any]) -> None:
    """Record the identity in the published directory and keep a hard-linked copy beside it."""
    write_json(out_dir / "launch.json", identity)
    copy = published_copy(out_dir)
    staging = copy.with_name(copy.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(out_dir, staging, copy_function=_link_or_copy)
    replace_dir(staging, copy, TRAINING_FOLDER)


def published_by_previous_owner(out_dir: Path, identity: dict[str, Any]) -> bool:
    """Snakemake deletes a job's output before running it, so an ``out_dir`` that exists once we own
    the training was published meanwhile by the owner we waited for (a SLURM job that outlived its
    workflow): reuse it if it is the same training."""
    record = out_dir / "launch.json"
    try:
        same = json.loads(record.read_text()) == identity
    except (OSError, ValueError):
        return False
    return same and (out_dir / "train.json").is_file()


def restore_published(out_dir: Path, identity: dict[str, Any]) -> bool:
    """Bring back a published training of the same identity that Snakemake deleted; True if done."""
    copy = published_copy(out_dir)
    record = copy / "launch.json"
    if out_dir.exists() or not record.is_file():
        return False
    try:
        if json.loads(record.read_text()) != identity or not (copy / "train.json").is_file():
            return False
    except ValueError:
        return False
    staging = out_dir.with_name(f".{out_dir.name}.restore")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(copy, staging, copy_function=_link_or_copy)
    replace_dir(staging, out_dir, TRAINING_FOLDER)
    return True


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
