"""The config stage's command line: exit status 2 and one line for every bad config."""

from __future__ import annotations

import subprocess
import sys

import yaml

from tests.support.helpers import base_config


def test_config_cli_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text(yaml.safe_dump(base_config({"r": {"lr": -1}})))
    proc = subprocess.run(
        [sys.executable, "-m", "shardfuse.config", "--configfile", str(bad)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "runs[r].lr" in proc.stderr
