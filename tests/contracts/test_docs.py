"""Lists in the README that quote the code: they must name what is there, all of it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def layout_block() -> str:
    return re.search(r"## Layout\n\n```\n(.*?)```", README, flags=re.DOTALL).group(1)


def test_readme_layout_names_every_script():
    scripts = sorted(path.name for path in (REPO / "scripts").glob("*.sh"))
    missing = [name for name in scripts if name not in layout_block()]
    assert not missing, f"README Layout block lacks {missing}"


def test_readme_names_every_stage_module_and_only_those():
    """'Each stage is a module you can also run by hand: ...' lists exactly the modules with a CLI."""
    listed = set(
        re.findall(r"`(\w+)`", README.split("Each stage is a module you can also run by hand", 1)[1][:400])
    )
    stages = {
        path.stem
        for path in (REPO / "src" / "shardfuse").glob("*.py")
        if re.search(r'^if __name__ == "__main__":', path.read_text(), flags=re.MULTILINE)
    }
    assert stages <= listed, f"README's stage list lacks {sorted(stages - listed)}"


def test_every_local_rule_is_declared_once_in_the_snakefile():
    rules_dir = REPO / "workflow" / "rules"
    assert all("localrules:" not in path.read_text() for path in rules_dir.glob("*.smk"))
    snakefile = (REPO / "Snakefile").read_text()
    assert snakefile.count("localrules:") == 1
