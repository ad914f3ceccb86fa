"""Run mergekit's own merge (``mergekit.merge.run_merge``, what ``mergekit-yaml`` calls) on several YAMLs in
one process, so mergekit's imports are paid once. Runs in mergekit's environment, not shardfuse's:

    $SHARDFUSE_MERGEKIT_PYTHON tests/support/mergekit_runner.py A.yml OUT_A B.yml OUT_B ...

Prints one JSON line per merge: {"config", "seconds"}; exits non-zero at the first failure.
"""

import json
import sys
import time

import yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import MergeOptions, run_merge


def main(argv: list[str]) -> None:
    options = MergeOptions(allow_crimes=True, quiet=True, write_model_card=False, random_seed=0)
    for config_file, out in zip(argv[::2], argv[1::2], strict=True):
        with open(config_file, encoding="utf-8") as fh:
            source = fh.read()
        started = time.perf_counter()
        run_merge(MergeConfiguration.model_validate(yaml.safe_load(source)), out, options, source)
        print(json.dumps({"config": config_file, "seconds": time.perf_counter() - started}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
