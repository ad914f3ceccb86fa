"""The README's cluster shapes: each example's sbatch line is what Snakemake and the plugin produce.

For every ``<!-- sbatch example: NAME -->`` section of the README, the test writes the section's
profile keys over a copy of profiles/slurm/config.yaml (a section without its own YAML uses the one
before it), the section's runs table into a copy of the default config, resolves the train job's
threads and resources with a real ``snakemake --dry-run`` through that profile, and builds the sbatch
line with snakemake-executor-plugin-slurm's own functions. The README line must match it exactly.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.support.helpers import REPO, snakemake_command, snakemake_failure, subprocess_env

README = REPO / "README.md"


def readme_examples() -> list[tuple[str, dict, str, str]]:
    """(name, profile keys, runs table, sbatch line) for each example section of the README."""
    text = README.read_text()
    sections = re.split(r"<!-- sbatch example: ([\w-]+) -->", text)[1:]
    examples = []
    profile: dict = {}
    for name, body in zip(sections[::2], sections[1::2], strict=True):
        blocks = re.findall(r"```(\w*)\n(.*?)```", body, flags=re.DOTALL)
        yaml_blocks = [code for lang, code in blocks if lang == "yaml"]
        if yaml_blocks:
            profile = {**profile, **yaml.safe_load(yaml_blocks[0])}
        plain = [code.strip() for lang, code in blocks if lang == ""]
        table = next(code for code in plain if code.startswith("run\t"))
        line = next(code for code in plain if code.startswith("sbatch "))
        examples.append((name, dict(profile), table, line))
    return examples


def parse_value(text: str):
    return int(text) if re.fullmatch(r"-?\d+", text) else text


def dry_run_train_job(workdir: Path, profile_dir: Path) -> tuple[str, int, dict]:
    """(training, threads, resources) of the one train job, as Snakemake resolves them."""
    proc = subprocess.run(
        snakemake_command(
            workdir, "--profile", profile_dir, "--dry-run", "--cores", "1024", "--until", "train"
        ),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    (block,) = re.findall(r"^rule train:\n(.*?)^Shell command", proc.stdout, flags=re.DOTALL | re.MULTILINE)
    training = re.search(r"wildcards: training=(\S+)", block).group(1)
    threads_match = re.search(r"threads: (\d+)", block)
    resources_line = re.search(r"resources: (.*)", block).group(1)
    resources = dict(item.split("=", 1) for item in resources_line.split(", "))
    return (
        training,
        int(threads_match.group(1)) if threads_match else 1,
        {key: parse_value(value) for key, value in resources.items()},
    )


class _Resources(dict):
    __getattr__ = dict.get


def plugin_sbatch_line(training: str, threads: int, resources: dict) -> str:
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    job = SimpleNamespace(resources=_Resources(resources), threads=threads)
    account = resources.get("slurm_account")
    partition = resources.get("slurm_partition")
    params = {
        # Placeholders that need no shell quoting, shown as <uuid> and <workdir> in the README.
        "run_uuid": "shardfuse_UUID",
        "slurm_logfile": f"WORKDIR/.snakemake/slurm_logs/rule_train/{training}/%j.log",
        "comment_str": f"rule_train_wildcards_{training}",
        # The plugin's own formatting of these two (get_account_arg, get_partition_arg).
        "account": f" -A {shlex.quote(str(account))}" if account else "",
        "partition": f" -p {shlex.quote(str(partition))}" if partition else "",
        "workdir": "WORKDIR",
    }
    line = " ".join((get_submit_command(job, params) + set_gres_string(job)).split())
    return line.replace("UUID", "<uuid>").replace("WORKDIR", "<workdir>").replace(training, "<training>")


EXAMPLES = readme_examples()


def test_the_readme_has_the_four_cluster_shapes():
    assert [name for name, *_ in EXAMPLES] == ["cpu", "gpu-node", "gpu-nodes", "gpu-fsdp"]


@pytest.mark.parametrize(("name", "profile", "table", "line"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_readme_sbatch_line_is_what_the_plugin_submits(tmp_path, name, profile, table, line):
    profile_dir = tmp_path / "profile"
    profile_dir.mkdir()
    cluster = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    (profile_dir / "config.yaml").write_text(yaml.safe_dump({**cluster, **profile}))
    workdir = tmp_path / "work"
    shutil.copytree(REPO / "config", workdir / "config")
    (workdir / "config" / "runs.tsv").write_text(table + "\n")

    training, threads, resources = dry_run_train_job(workdir, profile_dir)
    assert plugin_sbatch_line(training, threads, resources) == line
