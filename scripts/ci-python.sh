#!/usr/bin/env bash
# Sourced by .ci/run: the interpreter and the installer of CI's virtual environments, exported as
# CI_PYTHON, CI_INSTALLER (pip or uv) and CI_UV (uv's binary, when CI_INSTALLER=uv).
#
# The interpreter: Debian's python3 where it is 3.11+ with its venv module. Debian builds it with
# profile-guided optimisation and link-time optimisation; a source build without them (pyenv's
# default, this image's `python3`) spends 10-15 % more CPU on what this suite mostly does in Python
# (imports, Snakemake, MLflow, pandas): the default experiment took 100-105 s of CPU against 110-125 s.
#
# The installer: uv, where the disk holds the CPU build of the pinned torch (pip finds it through its
# find-links; uv is pointed at it and pinned to it, so it can never fetch the multi-GB CUDA build):
# the project's environment in 9 s on 2 cores against pip's 80 s. pip otherwise.
CI_PYTHON=python3
if /usr/bin/python3 -c 'import ensurepip, sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    CI_PYTHON=/usr/bin/python3
fi
CI_INSTALLER=pip
CI_UV=
ci_torch=$(sed -n 's/^torch==//p' constraints.txt)
ci_wheels=${PIP_FIND_LINKS:-/opt/wheels}
ci_uv=/tmp/shardfuse-uv  # uv's own folder: the machine's Python gets no package
if compgen -G "$ci_wheels/torch-$ci_torch+cpu-*.whl" >/dev/null &&
    python3 -m pip install -q --root-user-action=ignore --upgrade --target "$ci_uv" uv &&
    [ -x "$ci_uv/bin/uv" ]; then
    CI_INSTALLER=uv CI_UV=$ci_uv/bin/uv
    export UV_FIND_LINKS=$ci_wheels UV_CONSTRAINT=/tmp/shardfuse-uv-torch.txt
    echo "torch==$ci_torch+cpu" >"$UV_CONSTRAINT"
fi
export CI_PYTHON CI_INSTALLER CI_UV
echo "ci-python: $CI_PYTHON ($("$CI_PYTHON" --version 2>&1)), installer $CI_INSTALLER"
