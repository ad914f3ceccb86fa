"""shardfuse's ``python -m shardfuse.merge --mergekit FILE.yml --out DIR`` against mergekit's own
``mergekit-yaml FILE.yml DIR``: whole processes, the same YAML, the same model folders.

    python bench/mergekit_yaml.py                          # 4 x ~1 GiB and 8 x ~100 MiB, 2 repetitions
    python bench/mergekit_yaml.py --sizes 2x10 --reps 1    # a dry run (seconds)
    python bench/mergekit_yaml.py --sizes 8x100 --reps 3 --json results.json --max-busy 0.1

mergekit 0.1.5 lives in its own virtual environment (bench/mergekit_check.py says how to make one):
$SHARDFUSE_MERGEKIT_PYTHON, else /tmp/shardfuse-mergekit/bin/python; its ``mergekit-yaml`` is the script
beside it. shardfuse runs from this checkout's ``src`` with this interpreter. Nothing is downloaded:
mergekit runs with HF_HUB_OFFLINE=1 and every path in the YAML is absolute (mergekit reads a relative
name as a Hub id).

Inputs (under --root, default /tmp/mkbench, kept between runs and made again only if missing or of
another layout). ``scripts/make-pretrained.py`` makes a tiny GPT-2 folder once; its config.json and
tokenizer are the template of every model folder. For ``NxM`` (N fine-tunes of ~M MiB) a base and N
fine-tunes are written, each a folder with one float32 ``model.safetensors`` under GPT-2's tensor names
(``transformer.wte.weight``, ``transformer.h.N.attn.c_attn.weight``, ...; no ``lm_head``: tied, as
save_pretrained writes GPT-2) and a config.json of those shapes (``n_layer``, ``n_embd``, ...), so that
mergekit knows the folder as its ``gpt2`` architecture and can place each tensor on the gradients.
The layout is L layers of width d: L - 1 a power of two and d a multiple of 64 (the size nearest M).
The tensors are written one at a time (the generator holds the largest tensor, not the model):

  base        Gaussian (std 0.02), rounded to multiples of 2^-25, |value| <= 0.2
  fine-tune   base + tau, where |tau| of each tensor is a seeded permutation of 1..n times 2^e (the
              largest power of two with n 2^e <= 0.25, e >= -25) and its signs are seeded coin flips

so every value is exact in float32, ``fine-tune - base`` is exact in float32 (mergekit's arithmetic with
``dtype: float32``) and in float64 (shardfuse's), and the magnitudes of a task vector are distinct (no
ties at TIES's trim threshold, where the two tools would break a tie differently). The magnitudes are
uniform rather than bell-shaped like a real fine-tune's: mergekit's full sort does the same work on
either; shardfuse's bucketed selection may not.

The YAML (one per size): ``merge_method: ties``, the base as ``base_model``, every fine-tune with
``weight: 1.0`` and ``density: [0.25, 0.5, 0.75]`` (a gradient over the layers; one for all models,
which shardfuse's ties needs), ``parameters: {lambda: [0.75, 1.0]}`` and ``dtype: float32``. With
L - 1 a power of two and d a multiple of 64, density x numel is an integer for every tensor, so
mergekit's int(density n) and shardfuse's round(density n) keep the same count.

Measured. Each run is a child process measured as bench/common.py does (a bare interpreter forks the
command and reports its wall time, CPU time and ``ru_maxrss`` from ``os.wait4``, which covers the
processes it waited for); alongside, this process samples the command's process tree every 0.2 s
(/proc/PID/task/*/children, summing VmRSS) to confirm that each tool is one process (the ``processes``
column: the most seen at once) and to catch a concurrent helper a ``ru_maxrss`` would miss; the peak
reported is the larger of the two. The machine's busy CPU time outside the command (/proc/stat's busy
time over the run less the command's own CPU time, as a share of all cores) says whether anything else
ran meanwhile; with ``--max-busy F`` a run during which others kept more than F of the cores busy is
measured again (after 30 s, at most 5 more times; the discarded runs are in --json's output). Before
every run the previous output is deleted, ``sync`` flushes it, and every input file is read once, so
both tools read their inputs from the page cache (checked with util-linux's ``fincore`` where it
exists). The tools alternate A B A B (shardfuse first); both run with their default options
(mergekit-yaml with none: no --cuda, its default threads; OMP_NUM_THREADS and MKL_NUM_THREADS are unset
for both, so both see the machine's cores). Reported: min and median of the
repetitions; ratios mergekit / shardfuse time and shardfuse / mergekit peak RSS, from the medians (and
the speed-up also from the minima). Also each side's floor, a process that only imports the tool
(``import shardfuse.merge``; ``mergekit-yaml --help``, which imports mergekit's merge machinery and
torch).

Agreement. The outputs of the last repetition are compared tensor by tensor (max |difference|, entries
that differ, names only one side wrote), and each against TIES computed here in float64 from the input
files (numpy: each task vector's int(density n) largest magnitudes kept, the sign of their sum elected,
the agreeing kept values averaged, base + lambda x that, rounded to float32). The two tools differ by
design where the kept values sum to exactly 0 (a "sign tie": with integer magnitudes, e.g. tau_1 =
-tau_2): mergekit 0.1.5 elects + there (``sign_weight >= 0``) and averages the positive values, shardfuse
elects no sign and leaves the base; the reference follows each tool's rule, and the max |difference|
is also given outside the ties.

Targets (the issue): shardfuse >= 2x faster and <= 1/20 of mergekit-yaml's peak memory, at both sizes.
The exit status is 0 whatever the verdicts; a failed run raises.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

DEFAULT_SIZES = "4x1024,8x100"
DEFAULT_ROOT = Path("/tmp/mkbench")
DEFAULT_MERGEKIT_PYTHON = "/tmp/shardfuse-mergekit/bin/python"
DENSITY = [0.25, 0.5, 0.75]  # a gradient over the layers
LAMBDA = [0.75, 1.0]
SPEED_TARGET, MEMORY_TARGET = 2.0, 1 / 20
LAYER_COUNTS = (5, 9, 17)  # L - 1 a power of two: every layer's density is a multiple of 1 / (2 (L - 1))
WIDTH_STEP = 64  # d a multiple of 64 (GPT-2's head size), so density x numel is an integer
POSITIONS = 1024
MAX_NUMEL = 2**23  # the largest tensor whose tau magnitudes 1..n stay distinct multiples of 2^-25 <= 0.25
GRAIN = 2.0**-25  # every value is a multiple of it
BASE_STD, BASE_CLIP = 0.02, 0.2
LAYOUT_VERSION = 1  # bump when the generated values change: cached inputs are then made again
POLL_SECONDS = 0.2
RETRIES, RETRY_WAIT = 5, 30.0  # --max-busy: a run measured on a busy machine is repeated (at most 5 times)
READ_CHUNK = 64 << 20
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")


# ---------------------------------------------------------------- the model folders


@dataclass(frozen=True)
class Layout:
    """A GPT-2 of ``layers`` blocks of width ``width`` (tied embeddings: no lm_head)."""

    layers: int
    width: int
    vocab: int
    positions: int = POSITIONS

    def tensors(self) -> dict[str, tuple[int, ...]]:
        d = self.width
        shapes = {"transformer.wte.weight": (self.vocab, d), "transformer.wpe.weight": (self.positions, d)}
        for i in range(self.layers):
            block = f"transformer.h.{i}."
            shapes.update({
                block + "ln_1.weight": (d,), block + "ln_1.bias": (d,),
                block + "attn.c_attn.weight": (d, 3 * d), block + "attn.c_attn.bias": (3 * d,),
                block + "attn.c_proj.weight": (d, d), block + "attn.c_proj.bias": (d,),
                block + "ln_2.weight": (d,), block + "ln_2.bias": (d,),
                block + "mlp.c_fc.weight": (d, 4 * d), block + "mlp.c_fc.bias": (4 * d,),
                block + "mlp.c_proj.weight": (4 * d, d), block + "mlp.c_proj.bias": (d,),
            })  # fmt: skip
        shapes.update({"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)})
        return dict(sorted(shapes.items()))

    @property
    def nbytes(self) -> int:
        return 4 * sum(math.prod(shape) for shape in self.tensors().values())


def choose_layout(mib: float, vocab: int) -> Layout:
    """The layout whose float32 size is nearest ``mib`` MiB (ties: more layers)."""
    target = mib * 2**20
    candidates = [
        Layout(layers, width, vocab)
        for layers in LAYER_COUNTS
        for width in range(WIDTH_STEP, 4097, WIDTH_STEP)
        if 4 * width * width <= MAX_NUMEL
    ]
    return min(candidates, key=lambda lay: (abs(lay.nbytes - target), -lay.layers))


def base_values(index: int, numel: int) -> np.ndarray:
    """Tensor ``index`` of the base, float64, exact in float32."""
    gen = np.random.default_rng([LAYOUT_VERSION, 0, index])
    values = np.rint(gen.standard_normal(numel) * (BASE_STD / GRAIN))
    np.clip(values, -BASE_CLIP / GRAIN, BASE_CLIP / GRAIN, out=values)
    return values * GRAIN


def task_vector(model: int, index: int, numel: int) -> np.ndarray:
    """Fine-tune ``model``'s tau of tensor ``index``: distinct magnitudes, multiples of 2^-25, <= 0.25."""
    step = max(2.0 ** math.floor(math.log2(0.25 / numel)), GRAIN)
    gen = np.random.default_rng([LAYOUT_VERSION, model, index])
    tau = (gen.permutation(numel) + 1).astype(np.float64) * step
    tau[gen.random(numel) < 0.5] *= -1.0
    return tau


def write_safetensors(path: Path, layout: Layout, model: int) -> None:
    """``model`` 0: the base; k >= 1: fine-tune k. Written tensor by tensor (safetensors' format: an
    8-byte header length, the JSON header, the data in the header's order)."""
    shapes = layout.tensors()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for index, shape in enumerate(shapes.values()):
            numel = math.prod(shape)
            values = base_values(index, numel)
            if model:
                values += task_vector(model, index, numel)
            single = values.astype(np.float32)
            assert np.array_equal(single, values), "a value is not exact in float32"
            single.tofile(fh)


def make_template(root: Path) -> Path:
    """scripts/make-pretrained.py's tiny GPT-2: a valid config.json and tokenizer to copy."""
    template = root / "_template"
    if not (template / "config.json").is_file():
        subprocess.run(
            [common.PYTHON, common.REPO / "scripts" / "make-pretrained.py", template, "--layers", "2"],
            env=common.child_env(),
            check=True,
        )
    return template


def write_folder(folder: Path, template: Path, layout: Layout, model: int) -> None:
    folder.mkdir(parents=True)
    for item in template.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            shutil.copyfile(item, folder / item.name)
    config = json.loads((template / "config.json").read_text())
    config.update(
        n_layer=layout.layers,
        n_embd=layout.width,
        n_head=layout.width // 64,
        n_positions=layout.positions,
        vocab_size=layout.vocab,
        n_inner=None,
        tie_word_embeddings=True,
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(folder / "model.safetensors", layout, model)


def ensure_inputs(root: Path, num_models: int, mib: float) -> tuple[Path, list[Path], Layout]:
    """The base and fine-tune folders of size ``NxM`` under ``root``: made unless already there."""
    template = make_template(root)
    vocab = json.loads((template / "config.json").read_text())["vocab_size"]
    layout = choose_layout(mib, vocab)
    where = root / f"{num_models}x{mib:g}"
    names = ["base"] + [f"ft{k}" for k in range(1, num_models + 1)]
    spec = {"version": LAYOUT_VERSION, "layout": asdict(layout), "models": names}
    marker = where / "spec.json"

    def ready() -> bool:
        try:
            recorded = json.loads(marker.read_text())
        except (OSError, ValueError):
            return False
        sizes = recorded.pop("file_bytes", None)
        return recorded == spec and sizes == [
            (where / name / "model.safetensors").stat().st_size
            if (where / name / "model.safetensors").is_file()
            else None
            for name in names
        ]

    if not ready():
        shutil.rmtree(where, ignore_errors=True)
        started = time.perf_counter()
        for model, name in enumerate(names):
            write_folder(where / name, template, layout, model)
        sizes = [(where / name / "model.safetensors").stat().st_size for name in names]
        common.write_json(marker, {**spec, "file_bytes": sizes})
        print(f"wrote {where} in {time.perf_counter() - started:.0f} s", flush=True)
    folders = [where / name for name in names]
    return folders[0], folders[1:], layout


def write_yaml(path: Path, base: Path, models: list[Path]) -> Path:
    lines = ["merge_method: ties", f"base_model: {base}", "models:"]
    for model in models:
        lines += [
            f"  - model: {model}",
            "    parameters:",
            "      weight: 1.0",
            f"      density: {json.dumps(DENSITY)}",
        ]
    lines += ["parameters:", f"  lambda: {json.dumps(LAMBDA)}", "dtype: float32"]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------- measuring a child


@dataclass(frozen=True)
class Run:
    seconds: float
    cpu_seconds: float
    maxrss_mib: float  # ru_maxrss of the command (and the processes it waited for)
    tree_mib: float  # the most the sampled process tree held at once (VmRSS summed)
    processes: int  # the most processes seen at once in the command's tree
    others: (
        float  # the machine's busy CPU outside the command, as a share of all cores (0 on a quiet machine)
    )

    @property
    def peak_mib(self) -> float:
        return max(self.maxrss_mib, self.tree_mib)

    def describe(self) -> str:
        return (
            f"{self.seconds:.2f} s, peak {self.peak_mib:.0f} MiB (ru_maxrss {self.maxrss_mib:.0f}, tree "
            f"{self.tree_mib:.0f}, {self.processes} process(es)), CPU {self.cpu_seconds:.1f} s, others' CPU "
            f"{100 * self.others:.0f}% of the cores"
        )


_WRAPPER = """
import json, os, subprocess, sys, time
started = time.perf_counter()
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
seconds = time.perf_counter() - started
with open(sys.argv[1], "w") as fh:
    json.dump({"seconds": seconds, "maxrss_kb": usage.ru_maxrss,
               "cpu_seconds": usage.ru_utime + usage.ru_stime,
               "returncode": os.waitstatus_to_exitcode(status)}, fh)
"""


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{current}/task/{task}/children").read_text().split()
            except OSError:
                continue
            found += map(int, children)
            todo += map(int, children)
    return found


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measure(cmd: list[object], env: dict[str, str], log: Path) -> Run:
    """Run ``cmd`` to completion (its output to ``log``); a failure raises with the log's tail."""
    with tempfile.TemporaryDirectory(prefix="mkbench-") as tmp, open(log, "w") as out:
        report = Path(tmp) / "report.json"
        busy_before = _busy_seconds()
        wrapper = subprocess.Popen(
            [common.PYTHON, "-I", "-S", "-c", _WRAPPER, report, *map(str, cmd)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        tree = {"mib": 0.0, "processes": 0}
        done = threading.Event()

        def sample() -> None:
            while not done.wait(POLL_SECONDS):
                pids = _descendants(wrapper.pid)
                tree["processes"] = max(tree["processes"], len(pids))
                tree["mib"] = max(tree["mib"], sum(map(_rss_mib, pids)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        wrapper.wait()
        done.set()
        sampler.join()
        result = json.loads(report.read_text())
    if result["returncode"] != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({result['returncode']}):\n{tail}")
    busy = (_busy_seconds() - busy_before) - result["cpu_seconds"]
    return Run(
        result["seconds"],
        result["cpu_seconds"],
        result["maxrss_kb"] / 1024,
        tree["mib"],
        tree["processes"],
        max(busy, 0.0) / (result["seconds"] * (os.cpu_count() or 1)),
    )


def warm_up(files: list[Path]) -> None:
    """Read every file once: the runs then read them from the page cache."""
    buffer = bytearray(READ_CHUNK)
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buffer):
                pass


def resident_fraction(files: list[Path]) -> float | None:
    """The share of ``files``' bytes in the page cache (util-linux fincore), None without it."""
    if shutil.which("fincore") is None:
        return None
    proc = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES", *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        return None
    return sum(int(v) for v in proc.stdout.split()) / sum(p.stat().st_size for p in files)


def clean_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in THREAD_VARS}


# ---------------------------------------------------------------- the two tools


def mergekit_python() -> Path:
    path = Path(os.environ.get("SHARDFUSE_MERGEKIT_PYTHON") or DEFAULT_MERGEKIT_PYTHON)
    cli = path.parent / "mergekit-yaml"
    if not path.is_file() or not cli.is_file():
        sys.exit(
            f"mergekit_yaml: error: no mergekit at {path} (or no mergekit-yaml beside it); make its venv "
            "(bench/mergekit_check.py says how) or set SHARDFUSE_MERGEKIT_PYTHON"
        )
    return path


def tools(mk_python: Path) -> dict[str, tuple[list[object], dict[str, str]]]:
    """Each tool's command prefix (the YAML and the output folder follow) and environment."""
    theirs = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    theirs["PATH"] = os.pathsep.join([str(mk_python.parent), theirs.get("PATH", "")])
    theirs.update(OFFLINE)
    return {
        "shardfuse": (
            common.python_cmd("-m", "shardfuse.merge", "--mergekit", "{yaml}", "--out", "{out}"),
            clean_env(common.child_env()),
        ),
        "mergekit": ([mk_python.parent / "mergekit-yaml", "{yaml}", "{out}"], clean_env(theirs)),
    }


def floors(mk_python: Path, reps: int, logs: Path) -> dict[str, Run]:
    """Each tool's import floor: a process that imports the merge and exits."""
    envs = {name: env for name, (_, env) in tools(mk_python).items()}
    commands = {
        "shardfuse": (common.python_cmd("-c", "import shardfuse.merge"), envs["shardfuse"]),
        "mergekit": ([mk_python.parent / "mergekit-yaml", "--help"], envs["mergekit"]),
    }
    runs: dict[str, list[Run]] = {name: [] for name in commands}
    for rep in range(reps):
        for name, (cmd, env) in commands.items():
            runs[name].append(measure(cmd, env, logs / f"floor-{name}-{rep}.log"))
    return {name: min(values, key=lambda r: r.seconds) for name, values in runs.items()}


def versions(mk_python: Path) -> dict[str, str]:
    script = (
        "import importlib.metadata as m, json, platform; print(json.dumps({p: m.version(p) for p in "
        "('mergekit', 'torch', 'transformers', 'safetensors')} | {'python': platform.python_version()}))"
    )
    theirs = json.loads(subprocess.run([mk_python, "-c", script], capture_output=True, check=True).stdout)
    ours = {p: importlib.metadata.version(p) for p in ("numpy", "safetensors")}
    return {
        **{f"mergekit venv: {k}": v for k, v in theirs.items()},
        **{f"shardfuse venv: {k}": v for k, v in ours.items()},
        "shardfuse venv: python": platform.python_version(),
    }


# ---------------------------------------------------------------- comparing the outputs


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of ``folder`` holding it."""
    from safetensors import safe_open

    where = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "np") as fh:
            where.update(dict.fromkeys(fh.keys(), path))
    return where


def gradient(values: list[float], t: float) -> float:
    """mergekit's value of a gradient at t (linear between evenly spread values)."""
    scaled = t * (len(values) - 1)
    low = min(int(scaled), len(values) - 1)
    high = min(low + 1, len(values) - 1)
    frac = scaled - low
    return (1 - frac) * values[low] + frac * values[high]


def reference(name: str, base: np.ndarray, thetas: list[np.ndarray], layers: int) -> dict[str, np.ndarray]:
    """TIES by hand in float64 (before the float32 rounding): the kept entries' sum, and the result under
    each sign rule where the kept values sum to exactly 0 (shardfuse: none elected; mergekit: +)."""
    match = re.search(r"\.h\.(\d+)\.", name)
    t = int(match.group(1)) / (layers - 1) if match else 0.0  # outside the layers: t = 0
    density, scale = gradient(DENSITY, t), gradient(LAMBDA, t)
    kept = []
    for theta in thetas:
        tau = theta.astype(np.float64).ravel() - base
        k = max(1, int(density * tau.size))
        assert k == round(density * tau.size), "density x numel is not an integer"
        threshold = np.partition(np.abs(tau), tau.size - k)[tau.size - k]
        kept.append(np.where(np.abs(tau) >= threshold, tau, 0.0))  # magnitudes are distinct: k kept
    total = np.sum(kept, axis=0)
    results = {"tie": (total == 0) & np.any(np.stack(kept) != 0, axis=0)}
    for rule, sign in (("shardfuse", np.sign(total)), ("mergekit", np.where(total >= 0, 1.0, -1.0))):
        agree = [(tau * sign > 0) for tau in kept]
        agreeing = np.sum([np.where(a, tau, 0.0) for a, tau in zip(agree, kept, strict=True)], axis=0)
        count = np.maximum(np.sum(agree, axis=0), 1)
        results[rule] = base + scale * (agreeing / count)
    return results


def compare(ours: Path, theirs: Path, base: Path, models: list[Path], layers: int) -> dict[str, object]:
    """The two merged folders tensor by tensor, and each against the float64 reference under its own
    sign rule (rounded to float32). ``ties``: entries whose kept values sum to exactly 0."""
    from safetensors import safe_open

    a, b = weight_files(ours), weight_files(theirs)
    inputs = [base / "model.safetensors", *(m / "model.safetensors" for m in models)]
    stats = {
        "max_abs_diff": 0.0,
        "worst_tensor": None,
        "max_abs_diff_outside_ties": 0.0,
        "entries": 0,
        "entries_differing": 0,
        "ties": 0,
        "ties_differing": 0,
        "shardfuse_vs_reference_max": 0.0,
        "mergekit_vs_reference_max": 0.0,
    }
    dtypes = set()
    for name in sorted(a.keys() & b.keys()):
        with safe_open(str(a[name]), "np") as fa, safe_open(str(b[name]), "np") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
        if x.shape != y.shape:
            raise RuntimeError(f"{name}: shardfuse wrote {x.shape}, mergekit {y.shape}")
        dtypes.add(f"{x.dtype}/{y.dtype}")
        tensors = []
        for path in inputs:
            with safe_open(str(path), "np") as fh:
                tensors.append(fh.get_tensor(name))
        ref = reference(name, tensors[0].astype(np.float64).ravel(), tensors[1:], layers)
        x64, y64 = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
        diff = np.abs(x64 - y64)
        tie = ref["tie"]
        if diff.size and float(diff.max()) > stats["max_abs_diff"]:
            stats["max_abs_diff"], stats["worst_tensor"] = float(diff.max()), name
        outside = diff[~tie]
        if outside.size:
            stats["max_abs_diff_outside_ties"] = max(stats["max_abs_diff_outside_ties"], float(outside.max()))
        stats["entries"] += diff.size
        stats["entries_differing"] += int(np.count_nonzero(diff))
        stats["ties"] += int(np.count_nonzero(tie))
        stats["ties_differing"] += int(np.count_nonzero(diff[tie]))
        for side, got in (("shardfuse", x64), ("mergekit", y64)):
            want = ref[side].astype(np.float32).astype(np.float64)
            key = f"{side}_vs_reference_max"
            stats[key] = max(stats[key], float(np.abs(got - want).max(initial=0.0)))
    return {
        **stats,
        "tensors_compared": len(a.keys() & b.keys()),
        "only_shardfuse": sorted(a.keys() - b.keys()),
        "only_mergekit": sorted(b.keys() - a.keys()),
        "dtypes": sorted(dtypes),
    }


# ---------------------------------------------------------------- the benchmark


def parse_sizes(text: str) -> list[tuple[int, float]]:
    sizes = []
    for item in text.split(","):
        try:
            count, mib = item.lower().split("x")
            sizes.append((int(count), float(mib)))
        except ValueError:
            sys.exit(f"mergekit_yaml: error: --sizes {item!r} is not NxMIB (e.g. 4x1024)")
    return sizes


def bench_size(
    root: Path, num_models: int, mib: float, reps: int, mk_python: Path, keep: bool, max_busy: float | None
) -> dict[str, object]:
    base, models, layout = ensure_inputs(root, num_models, mib)
    where = base.parent
    inputs = [folder / "model.safetensors" for folder in [base, *models]]
    yaml = write_yaml(where / "ties.yml", base, models)
    logs = where / "logs"
    logs.mkdir(exist_ok=True)
    runs: dict[str, list[Run]] = {"shardfuse": [], "mergekit": []}
    resident, discarded = [], []
    for rep in range(reps):
        for name, (prefix, env) in tools(mk_python).items():
            out = where / f"out-{name}"
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            warm_up(inputs)
            resident.append(resident_fraction(inputs))
            cmd = [str(p).replace("{yaml}", str(yaml)).replace("{out}", str(out)) for p in prefix]
            for attempt in range(1 + (RETRIES if max_busy is not None else 0)):
                if attempt:
                    shutil.rmtree(out, ignore_errors=True)
                    time.sleep(RETRY_WAIT)
                    warm_up(inputs)
                run = measure(cmd, env, logs / f"{name}-{rep}.log")
                print(f"{num_models}x{mib:g} rep {rep} {name}: {run.describe()}", flush=True)
                if max_busy is None or run.others <= max_busy:
                    break
                discarded.append(asdict(run) | {"tool": name, "rep": rep})
                print(f"  others' CPU above --max-busy {max_busy:g}: measured again", flush=True)
            runs[name].append(run)
    agreement = compare(where / "out-shardfuse", where / "out-mergekit", base, models, layout.layers)
    print(f"{num_models}x{mib:g} outputs: {json.dumps(agreement)}", flush=True)
    if not keep:
        for name in runs:
            shutil.rmtree(where / f"out-{name}", ignore_errors=True)
    known = [f for f in resident if f is not None]
    return {
        "models": num_models,
        "mib": mib,
        "layout": asdict(layout),
        "file_mib": inputs[0].stat().st_size / 2**20,
        "yaml": str(yaml),
        "runs": {
            name: [asdict(r) | {"peak_mib": r.peak_mib} for r in values] for name, values in runs.items()
        },
        "resident_min": min(known) if known else None,
        "discarded": discarded,
        "agreement": agreement,
    }


def summarise(result: dict) -> dict[str, float]:
    ours, theirs = result["runs"]["shardfuse"], result["runs"]["mergekit"]

    def stat(runs: list[dict], key: str, fn) -> float:
        return float(fn([r[key] for r in runs]))

    s = {
        f"{side}_{key}_{how}": stat(runs, key, fn)
        for side, runs in (("sf", ours), ("mk", theirs))
        for key in ("seconds", "peak_mib", "cpu_seconds")
        for how, fn in (("min", min), ("median", statistics.median))
    }
    s["speedup_median"] = s["mk_seconds_median"] / s["sf_seconds_median"]
    s["speedup_min"] = s["mk_seconds_min"] / s["sf_seconds_min"]
    s["memory_median"] = s["sf_peak_mib_median"] / s["mk_peak_mib_median"]
    s["processes"] = max(r["processes"] for r in ours + theirs)
    s["others_max"] = max(r["others"] for r in ours + theirs)
    return s


def report(results: list[dict], reps: int, floor: dict[str, Run]) -> str:
    rows = []
    for result in results:
        s, lay, agree = summarise(result), result["layout"], result["agreement"]
        fast, lean = s["speedup_median"] >= SPEED_TARGET, s["memory_median"] <= MEMORY_TARGET
        rows.append(
            [
                f"{result['models']} x {result['mib']:g}",
                f"{lay['layers']} x {lay['width']} ({result['file_mib']:,.0f} MiB)",
                f"{s['sf_seconds_min']:.2f} / {s['sf_seconds_median']:.2f}",
                f"{s['sf_peak_mib_min']:,.0f} / {s['sf_peak_mib_median']:,.0f}",
                f"{s['sf_cpu_seconds_median']:.1f}",
                f"{s['mk_seconds_min']:.2f} / {s['mk_seconds_median']:.2f}",
                f"{s['mk_peak_mib_min']:,.0f} / {s['mk_peak_mib_median']:,.0f}",
                f"{s['mk_cpu_seconds_median']:.1f}",
                f"{s['speedup_median']:.2f}x ({s['speedup_min']:.2f}x)",
                f"1/{1 / s['memory_median']:.1f}",
                f"{common.verdict(fast)} / {common.verdict(lean)}",
                f"{agree['max_abs_diff']:.3g} / {agree['max_abs_diff_outside_ties']:.3g}",
                f"{agree['ties']:,} ({agree['ties_differing']:,} differ)",
            ]
        )
    header = [
        "N x MiB",
        "layers x width (file)",
        "shardfuse s (min / median)",
        "shardfuse peak MiB (min / median)",
        "shardfuse CPU s",
        "mergekit-yaml s (min / median)",
        "mergekit-yaml peak MiB (min / median)",
        "mergekit-yaml CPU s",
        "speed-up, medians (minima)",
        "memory, medians",
        ">= 2x / <= 1/20",
        "max abs diff: all / outside sign ties",
        "sign ties",
    ]
    note = (
        f"{reps} repetitions, A B A B (shardfuse first). Import floors (a process that imports the tool "
        f"and exits, best of {reps}): shardfuse {floor['shardfuse'].seconds:.2f} s, "
        f"{floor['shardfuse'].peak_mib:.0f} MiB; mergekit-yaml --help {floor['mergekit'].seconds:.2f} s, "
        f"{floor['mergekit'].peak_mib:.0f} MiB. Processes in each measured tree at once: at most "
        f"{max(summarise(r)['processes'] for r in results)}. Busy CPU outside the measured command during a "
        "run, as a share of all cores (a quiet machine: ~0): at most "
        + ", ".join(
            f"{100 * summarise(r)['others_max']:.0f}% ({r['models']} x {r['mib']:g})" for r in results
        )
        + ". Share of the input bytes in the page cache before a run, at least: "
        + ", ".join(
            f"{100 * r['resident_min']:.1f}% ({r['models']} x {r['mib']:g})"
            for r in results
            if r["resident_min"] is not None
        )
        + "."
    )
    return common.table(header, rows) + "\n\n" + note


def main() -> None:
    parser = argparse.ArgumentParser(
        description="shardfuse --mergekit against mergekit-yaml: whole processes on the same TIES YAML"
    )
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="NxMIB,...: N fine-tunes of ~MIB MiB each")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of each tool per size")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="where the model folders live")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument("--keep-outputs", action="store_true", help="keep the last merged folders")
    parser.add_argument(
        "--max-busy",
        type=float,
        help="repeat a run (after 30 s, up to 5 times) while other processes kept more than this share of "
        "the cores busy during it (e.g. 0.1); the last try counts. Default: keep every run",
    )
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    sizes = parse_sizes(args.sizes)
    mk_python = mergekit_python()
    args.root = args.root.resolve()  # mergekit reads a relative path as a Hub id
    args.root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    info = {
        "date": subprocess.run(["date", "-u"], capture_output=True, text=True).stdout.strip(),
        "machine": f"{os.cpu_count()} cores {platform.machine()}, {common._ram_gib():.1f} GiB",
        "load average at start": common.load_average(),
        **versions(mk_python),
    }
    print(json.dumps(info, indent=2), flush=True)
    results = [
        bench_size(args.root, n, mib, args.reps, mk_python, args.keep_outputs, args.max_busy)
        for n, mib in sizes
    ]
    (args.root / "logs").mkdir(exist_ok=True)
    floor = floors(mk_python, args.reps, args.root / "logs")
    info["load average at end"] = common.load_average()
    info["minutes"] = f"{(time.perf_counter() - started) / 60:.1f}"
    text = report(results, args.reps, floor)
    print("\n" + text + "\n", flush=True)
    print(json.dumps({k: info[k] for k in ("load average at end", "minutes")}), flush=True)
    if args.json:
        common.write_json(
            args.json,
            {"info": info, "results": results, "floors": {k: asdict(v) for k, v in floor.items()}},
        )


if __name__ == "__main__":
    main()
