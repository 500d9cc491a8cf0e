"""The automodel test matrix. Run everything with ``uvx nox``; list the sessions with ``uvx nox -l``.

Every session builds its environment with ``uv sync --frozen``, so what runs is exactly the committed
uv.lock; uv's cache makes that a matter of seconds (hard links), and a fresh clone behaves like a warm
one. Each ``unit`` session gets a virtual environment of its own holding one package and what it
declares. The sessions that need the whole workspace (typecheck, lean_import, distributed, e2e, faults,
models, benchmarks, gpu) share one, `WORKSPACE_ENV`, synced at the start of each (a no-op when it is
current): Python compiles the bytecode of torch, transformers and the rest on first import, about 12 s
of a 2-core machine per environment, so one shared environment pays it once per run.

Test tiers, disjoint so that each test runs once in the default run:

- ``unit(package=...)``: ``-m "not gpu and not distributed and not models"`` over one package's tests, in an
  environment holding only that package, its declared dependencies and its ``test`` group;
- ``distributed``: ``-m "distributed and not gpu and not faults and not extended"`` over every package's
  tests and ``tests/``, in the whole workspace;
- ``distributed_extended``: the ``extended`` multi-process checks (4 and 8 ranks where 2-rank tests of the
  default run cover the mechanism, further ``automodel train`` jobs, the opt-in CPU runtime's heavier
  checks); not a default;
- ``e2e``: ``tests/`` (cross-package), ``-m "not gpu and not distributed and not faults"``, whole workspace;
- ``faults``: ``tests/faults/`` (``-m "faults and not gpu and not slow_faults"``): property tests of
  every config and mesh layout, the bad-configuration corpus, faults injected into real gloo ranks and
  into ``automodel train`` jobs; prints the ledger table of docs/faults.md and writes it as JSON;
- ``faults_slow``: the fault cases that cost a minute or more each (``-m "slow_faults and not gpu"``:
  two simulated nodes, the skip-on-NaN job); not a default;
- ``gpu(gpus=N)``: ``-m gpu`` with N CUDA devices; skips when the machine has fewer. Not a default.

pytest exits with 5 when it selects no test. That is accepted only where there is nothing to run yet
(a package without test files, or a tier none of whose tests exist yet), and the session says so in
a line starting with "NO TESTS".
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn
from xml.etree import ElementTree

import nox
from nox.command import CommandFailed
from nox.logger import logger

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))

import dependency_graph as graph  # noqa: E402

nox.needs_version = ">=2025.2.9"
# Some machines export PYTHONDONTWRITEBYTECODE=1. uv installs no .pyc files, so every process -- and a
# distributed test starts several per launch -- would compile torch, sympy and transformers from source
# each time (10-20 s a launch). Let the sessions' interpreters cache bytecode in their own venvs.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

nox.options.default_venv_backend = "uv"
nox.options.error_on_external_run = True
nox.options.sessions = [
    "depgraph",
    "lint",
    "typecheck",
    "unit",
    "lean_import",
    "distributed",
    "e2e",
    "faults",
    "wheels",
    "docs",
]

PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
PUBLISHED = [d for d in PACKAGES if graph.ALLOWED_GRAPH.get(d, graph.Node()).published]
GPU_COUNTS = [1, 2, 4, 8]
# The whole workspace: every package, every extra (so lazy paths and lean-import checks have the optional
# libraries to find), the root dev tools and every package's test group.
WORKSPACE_SYNC = ("--all-packages", "--all-extras", "--group", "dev", "--group", "test")


SINGLE_PROCESS_WORKERS = min(4, os.cpu_count() or 1)
"""pytest-xdist workers of the single-process tiers (``unit``, ``e2e``), mypy's workers, and the wheel
checks run at once: each runs one Python thread, so on the 2-core CI machine two workers halve them.
The multi-process tiers run serially: their ranks already fill the cores."""

WORKSPACE_ENV = ROOT / ".nox" / "workspace"
"""The environment of the whole-workspace sessions (``WORKSPACE_SYNC``), shared by all of them."""


def _timed(func: Callable[..., None]) -> Callable[..., None]:
    """Log the session's own wall time when it ends, however it ends (nox's summary rounds to minutes)."""

    @functools.wraps(func)
    def wrapper(session: nox.Session, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            func(session, *args, **kwargs)
        finally:
            session.log(f"wall time of {session.name}: {time.perf_counter() - start:.1f} s")

    return wrapper


def _fail(message: str) -> NoReturn:
    """Fail the session (reported as "failed", like a failing command) with an explanation."""
    logger.error(message)
    raise CommandFailed(message)


def _uv_sync(session: nox.Session, *args: str) -> None:
    """Install the locked environment described by ``args`` into this session's virtualenv, exactly."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--quiet",
        "--no-default-groups",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


def _workspace(session: nox.Session) -> dict[str, str]:
    """Sync `WORKSPACE_ENV` for a ``venv_backend="none"`` session; return the environment to run in it.

    Commands in it are run as ``session.run(_bin(name), ..., env=..., external=True)``: nox resolves a
    bare program name on its own ``PATH``, not on the ``env`` it is given.
    """
    session.run(
        "uv", "sync", "--frozen", "--quiet", "--no-default-groups", "--python", sys.executable,
        *WORKSPACE_SYNC, env={"UV_PROJECT_ENVIRONMENT": str(WORKSPACE_ENV)}, external=True,
    )  # fmt: skip
    return {"VIRTUAL_ENV": str(WORKSPACE_ENV), "PATH": f"{_bin('')}{os.pathsep}{os.environ.get('PATH', '')}"}


def _bin(program: str) -> str:
    """``program`` in `WORKSPACE_ENV`'s ``bin`` folder (the folder itself for ``""``)."""
    return str(WORKSPACE_ENV / "bin" / program) if program else str(WORKSPACE_ENV / "bin")


def _has_test_files(*folders: Path) -> bool:
    return any(any(f.rglob("test_*.py")) or any(f.rglob("*_test.py")) for f in folders if f.is_dir())


def _pytest(
    session: nox.Session,
    paths: list[Path],
    marker: str,
    *,
    allow_empty: bool,
    what: str,
    why_empty: str,
    env: dict[str, str] | None = None,
    workspace: dict[str, str] | None = None,
    parallel: bool = False,
) -> None:
    """Run pytest over ``paths``; in `WORKSPACE_ENV` when ``workspace`` (`_workspace`'s result) is given.

    Exit code 5 (no test selected) is accepted only when ``allow_empty``; then a line starting with
    "NO TESTS COLLECTED" names ``what`` and gives ``why_empty``. ``parallel`` spreads the test files over
    `SINGLE_PROCESS_WORKERS` (``--dist loadfile``: a file's tests and module fixtures stay together).
    """
    existing = [str(p.relative_to(ROOT)) for p in paths if p.is_dir()]
    if not existing and not allow_empty:
        _fail(f"no test folder for {what} among {[str(p) for p in paths]}")
    if not existing:
        session.log(f"NO TESTS COLLECTED for {what}: {why_empty} (no test folder exists; pytest not run)")
        return
    junit = Path(session.create_tmp()) / "junit.xml"
    junit.unlink(missing_ok=True)
    try:
        session.run(
            _bin("pytest") if workspace else "pytest",
            *existing,
            "-m",
            marker,
            f"--junit-xml={junit}",
            *(["-n", str(SINGLE_PROCESS_WORKERS), "--dist", "loadfile"] if parallel else []),
            *session.posargs,
            env={**(workspace or {}), **(env or {})},
            external=bool(workspace),
            success_codes=[0, 5] if allow_empty else [0],
        )
    except CommandFailed as exc:
        if exc.return_code == 5:
            _fail(
                f"pytest selected no test for {what} (exit code 5), although its folders hold test files: "
                f"exit code 5 is accepted only where there are no tests yet (marker: {marker!r})"
            )
        raise
    if junit.is_file():
        suites = ElementTree.parse(junit).getroot().iter("testsuite")
        if sum(int(s.get("tests", "0")) for s in suites) == 0:
            session.log(f"NO TESTS COLLECTED for {what}: {why_empty} (pytest exit code 5, accepted)")


# --- repository checks ---------------------------------------------------------------------------------


@nox.session
@_timed
def depgraph(session: nox.Session) -> None:
    """uv.lock matches the pyprojects, and packages depend on and import only what the graph allows."""
    session.run("uv", "lock", "--check", external=True)
    session.run("python", "tools/check_dependency_graph.py")


@nox.session
@_timed
def lint(session: nox.Session) -> None:
    """Ruff lint and format checks over the whole repository."""
    _uv_sync(session, "--only-group", "dev")
    failed = []
    for args in (["check", "."], ["format", "--check", "."]):
        try:
            session.run("ruff", *args)
        except CommandFailed:
            failed.append("ruff " + " ".join(args))
    if failed:
        _fail("failed: " + "; ".join(failed))


@nox.session(venv_backend="none")
@_timed
def typecheck(session: nox.Session) -> None:
    """Mypy (strict, configured in the root pyproject.toml) over every package's sources and tools/."""
    env = _workspace(session)
    sources = [str(p.relative_to(ROOT)) for p in sorted(ROOT.glob("packages/*/src"))]
    workers = ("--num-workers", str(SINGLE_PROCESS_WORKERS))  # 65 s instead of 89 s on 2 cores
    session.run(_bin("mypy"), *workers, *sources, "tools", env=env, external=True)


@nox.session(venv_backend="none")
@_timed
def lean_import(session: nox.Session) -> None:
    """``import <package>``: no CUDA initialised, no heavy module, <= 1.2x the time of ``import torch``."""
    env = _workspace(session)
    session.run(_bin("python"), "tools/check_lean_import.py", *session.posargs, env=env, external=True)


@nox.session
@_timed
def docs(session: nox.Session) -> None:
    """Build the documentation site; warnings (broken links, pages missing from the nav) fail it.

    The API pages come from mkdocstrings reading ``packages/*/src`` statically (griffe), so the docs
    group alone is enough: neither torch nor our packages are installed here.
    """
    _uv_sync(session, "--only-group", "docs")
    site = Path(session.create_tmp()) / "site"
    session.run("mkdocs", "build", "--strict", "--site-dir", str(site), env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(default=False, venv_backend="none")
@_timed
def benchmarks(session: nox.Session) -> None:
    """Every benchmark, one table of ratios against baselines measured in the same run (not a default).

    ``uvx nox -s benchmarks -- --only nemo imports`` runs some sections; ``-- --json out.json`` also
    writes the rows. The NeMo AutoModel rows install ``nemo-automodel`` from PyPI into a scratch venv
    (a network is needed; without one those rows say why).
    """
    env = {**_workspace(session), "OMP_NUM_THREADS": "1"}
    session.run(_bin("python"), "benchmarks/run_all.py", *session.posargs, env=env, external=True)


# --- tests ---------------------------------------------------------------------------------------------


@nox.session
@nox.parametrize("package", PACKAGES)
@_timed
def unit(session: nox.Session, package: str) -> None:
    """One package's single-process tests, installed with only its declared dependencies + test group."""
    _uv_sync(session, "--package", package, "--group", "test")
    _check_slim_environment(session, package)
    tests = ROOT / "packages" / package / "tests"
    has_tests = _has_test_files(tests)
    _pytest(
        session,
        [tests],
        "not gpu and not distributed and not models",
        allow_empty=not has_tests,
        what=package,
        why_empty="the package has no test files yet",
        parallel=True,
    )


def _check_slim_environment(session: nox.Session, package: str) -> None:
    """Fail unless the environment holds only what the lock says ``package`` + its test group pull in."""
    listing = session.run(
        "uv", "pip", "list", "--format", "json", "--python", session.virtualenv.location,
        silent=True, external=True, log=False,
    )  # fmt: skip
    installed = {graph.normalize(item["name"]) for item in json.loads(str(listing).strip().splitlines()[-1])}
    lock = graph.read_lock()
    allowed = graph.lock_closure(lock, [(package, ["@test"])])
    stray = sorted(installed - allowed)
    if stray:
        _fail(f"{package}: installed but not required by it or its test group: {', '.join(stray)}")
    watched = {
        graph.normalize(d) for d in graph.expected_absent(package, graph.read_workspace(), lock).values()
    }
    session.log(
        f"{package} environment: {len(installed)} distributions, all required by it or its test group"
    )
    session.log(f"  ours: {', '.join(sorted(d for d in installed if d.startswith('automodel-')))}")
    session.log(f"  absent, as its dependencies say: {', '.join(sorted(watched - installed)) or '-'}")


def _distributed(session: nox.Session, marker: str) -> None:
    workspace = _workspace(session)
    folders = [*sorted(ROOT.glob("packages/*/tests")), ROOT / "tests"]
    _pytest(
        session,
        folders,
        marker,
        allow_empty=True,
        what="the distributed tier",
        why_empty="no test is marked `distributed` yet",
        workspace=workspace,
    )


@nox.session(venv_backend="none")
@_timed
def distributed(session: nox.Session) -> None:
    """Multi-process tests on real gloo process groups (run_distributed), all but the ``extended`` ones."""
    _distributed(session, "distributed and not gpu and not faults and not extended")


@nox.session(default=False, venv_backend="none")
@_timed
def distributed_extended(session: nox.Session) -> None:
    """The multi-process checks beyond the default slice (``extended``: 4 and 8 ranks, further train jobs)."""
    _distributed(session, "distributed and extended and not gpu and not faults")


@nox.session(venv_backend="none")
@_timed
def e2e(session: nox.Session) -> None:
    """Cross-package tests in ``tests/`` (the wheel-install checks are the ``wheels`` session)."""
    workspace = _workspace(session)
    tests = ROOT / "tests"
    _pytest(
        session,
        [tests],
        "not gpu and not distributed and not faults and not models",
        allow_empty=not _has_test_files(tests),
        what="tests/",
        why_empty="there are no cross-package test files yet",
        workspace=workspace,
        parallel=True,
    )


def _faults(session: nox.Session, marker: str) -> None:
    workspace = _workspace(session)
    report = Path(session.create_tmp()) / "faults-report.json"
    report.unlink(missing_ok=True)
    _pytest(
        session,
        [ROOT / "tests" / "faults"],
        marker,
        allow_empty=False,
        what="the faults tier",
        why_empty="",
        env={"AUTOMODEL_FAULTS_REPORT": str(report)},
        workspace=workspace,
    )
    if not report.is_file():
        _fail(f"the faults run wrote no ledger at {report}")
    totals = json.loads(report.read_text(encoding="utf-8"))["totals"]
    session.log(f"faults ledger ({report}): {totals}")


@nox.session(default=False, venv_backend="none")
@_timed
def models(session: nox.Session) -> None:
    """The whole model matrix: every transformers decoder and VLM family x every layout (not default).

    Writes the JSON reports and regenerates docs/models.md and docs/vlm.md (``tools/models_doc.py``).
    The default ``distributed`` session runs a fast slice of the same matrix. ``-- -k fsdp2`` runs some
    layouts. Also every published run the planner predicts (``models``-marked planner tests: the
    default ``unit`` session runs the calibration rows and the small models' rows).
    """
    workspace = _workspace(session)
    report = ROOT / "build" / "models" / "matrix.json"
    vlm_report = ROOT / "build" / "models" / "vlm.json"
    report.unlink(missing_ok=True)
    vlm_report.unlink(missing_ok=True)
    failed = False
    try:
        _pytest(
            session,
            [ROOT / "tests" / "models", ROOT / "packages" / "automodel-planner" / "tests"],
            "models",
            allow_empty=False,
            what="the model matrix",
            why_empty="",
            env={
                "AUTOMODEL_MODEL_MATRIX_REPORT": str(report),
                "AUTOMODEL_VLM_MATRIX_REPORT": str(vlm_report),
                "OMP_NUM_THREADS": "1",
            },
            workspace=workspace,
        )
    except CommandFailed:
        failed = True  # the table is written either way: it shows what failed
    if not report.is_file():
        _fail(f"the model matrix wrote no report at {report}")
    doc = (_bin("python"), "tools/models_doc.py")
    session.run(*doc, str(report), "docs/models.md", "docs/moe.md", env=workspace, external=True)
    if vlm_report.is_file():  # absent when ``-k`` selected decoder layouts only
        session.run(*doc, str(vlm_report), "docs/vlm.md", env=workspace, external=True)
    if failed:
        _fail("some (family, layout) cases failed: see docs/models.md and the pytest output")


OLDEST_PYTHON = "3.11"
"""The oldest Python we declare (``requires-python``); the GPU image has 3.12."""
OLDEST_SLICE = (
    "packages/automodel-distributed/tests/distributed",
    "packages/automodel-checkpoint/tests/distributed",
    "tests/models/test_model_matrix.py::test_fast_slice",
)
"""The distributed tests `oldest` runs: FSDP2/TP/CP/DDP, distributed checkpoints, the matrix's fast slice."""


def _editable_with_extras() -> list[str]:
    """``-e packages/<name>[every extra]`` for every package, and every package's ``test`` group."""
    import tomllib

    args, tests = [], set()
    for folder in sorted(ROOT.glob("packages/*/pyproject.toml")):
        data = tomllib.loads(folder.read_text())
        extras = ",".join(sorted(data["project"].get("optional-dependencies", {})))
        args += ["-e", f"{folder.parent.relative_to(ROOT)}[{extras}]" if extras else str(folder.parent)]
        tests |= {r for r in data.get("dependency-groups", {}).get("test", []) if isinstance(r, str)}
    return args + sorted(r for r in tests if not r.startswith("automodel-"))


@nox.session(python=OLDEST_PYTHON, default=False)
@_timed
def oldest(session: nox.Session) -> None:
    """The lower bounds we declare, tested: every package at the oldest versions its pyproject allows.

    uv's ``--resolution lowest-direct`` installs the lowest version each ``pyproject.toml`` admits for
    every direct dependency (torch, transformers, peft, safetensors, torchao, ...; their own
    dependencies at the newest that fit), on the oldest Python we support. Then every package's unit
    tests, a distributed slice (`OLDEST_SLICE`) and the GPU check's CPU rehearsal run there, each even
    when one before it failed. Not a default session (the downloads are large); the versions it ran
    are printed first.
    """
    session.run_install(
        "uv", "pip", "install", "--quiet", "--resolution", "lowest-direct",
        "--python", session.virtualenv.location, *_editable_with_extras(), external=True,
    )  # fmt: skip
    session.run(
        "python",
        "-c",
        "import torch, transformers, peft, safetensors, torchao; "
        "print({m.__name__: m.__version__ for m in (torch, transformers, peft, safetensors, torchao)})",
    )
    env = {"OMP_NUM_THREADS": "1"}
    units = sorted(ROOT.glob("packages/*/tests"))
    slice_ = [str(ROOT / path) for path in OLDEST_SLICE]
    rehearsal = {**env, "PYTHON": "python", "OUT": session.create_tmp() + "/gpu_check"}
    parts: dict[str, Callable[[], Any]] = {
        "unit tests": lambda: _pytest(
            session,
            units,
            "not gpu and not distributed and not models",
            allow_empty=False,
            what="unit",
            why_empty="",
            env=env,
        ),
        "distributed slice": lambda: session.run(
            "pytest", *slice_, "-m", "not gpu and not faults", *session.posargs, env=env
        ),
        "GPU check rehearsal": lambda: session.run(
            "bash", "tools/gpu_check.sh", "--rehearse", env=rehearsal, external=True
        ),
    }
    failed = []
    for name, run in parts.items():  # every part runs, so one run shows all that fails at these versions
        try:
            run()
        except CommandFailed:
            failed.append(name)
    if failed:
        _fail(f"at the oldest versions, these failed: {', '.join(failed)}")


@nox.session
@_timed
def faults(session: nox.Session) -> None:
    """Bad inputs, injected faults and hangs (tests/faults); prints and writes the docs/faults.md ledger."""
    _faults(session, "faults and not gpu and not slow_faults")


@nox.session(default=False)
@_timed
def faults_slow(session: nox.Session) -> None:
    """The fault cases of a minute or more each (``slow_faults``: two simulated nodes, skip-on-NaN)."""
    _faults(session, "slow_faults and not gpu")


@nox.session(venv_backend="none")
@nox.parametrize("gpus", GPU_COUNTS)
@_timed
def gpu(session: nox.Session, gpus: int) -> None:
    """GPU tests (``-m gpu``) with exactly ``gpus`` visible CUDA devices; skips on smaller machines."""
    workspace = _workspace(session)
    probe = "import torch; print(torch.cuda.device_count())"
    output = session.run(_bin("python"), "-c", probe, silent=True, env=workspace, external=True)
    found = int(str(output).strip().splitlines()[-1])
    if found < gpus:
        session.skip(f"needs {gpus} CUDA devices, found {found}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",")[:gpus] if visible else [str(i) for i in range(gpus)]
    env = {"AUTOMODEL_TEST_GPUS": str(gpus), "CUDA_VISIBLE_DEVICES": ",".join(devices)}
    folders = [*sorted(ROOT.glob("packages/*/tests")), ROOT / "tests"]
    _pytest(
        session,
        folders,
        "gpu",
        allow_empty=True,
        what=f"the gpu tier on {gpus} GPUs",
        why_empty="no test is marked `gpu` yet",
        env=env,
        workspace=workspace,
    )


# --- wheels --------------------------------------------------------------------------------------------

_INSTALLED_CHECK = r"""
import importlib, importlib.metadata as md, importlib.util, json, os, sys
name, must_be_absent = sys.argv[1], sys.argv[2:]
module = importlib.import_module(name)
records = {}
for dist in md.distributions():
    if dist.metadata["Name"].startswith("automodel"):
        lines = (dist.read_text("RECORD") or "").splitlines()
        # Console scripts are generated at install time, outside site-packages ("../../../bin/..").
        records[dist.metadata["Name"]] = sorted(
            line for line in lines if ".dist-info/" not in line and not line.startswith("../")
        )
scripts = {
    ep.name: os.path.isfile(os.path.join(os.path.dirname(sys.executable), ep.name))
    for dist in md.distributions() if dist.metadata["Name"].startswith("automodel")
    for ep in dist.entry_points if ep.group == "console_scripts"
}
print(json.dumps({
    "file": module.__file__,
    "version": getattr(module, "__version__", None),
    "present": [m for m in must_be_absent if importlib.util.find_spec(m) is not None],
    "records": records,
    "scripts": scripts,
}))
"""


# Examples that must run with nothing but the package's own wheel installed (its README's promise).
_RUN_ALONE = {"automodel-checkpoint": "docs/examples/checkpoints_example.py"}


@nox.session
@_timed
def wheels(session: nox.Session) -> None:
    """Build every wheel; install each published one alone, from the wheels, in a fresh venv; check it."""
    workspace = graph.read_workspace()
    lock = graph.read_lock()
    tmp = Path(tempfile.mkdtemp(prefix="automodel-wheels-"))  # outside the workspace on purpose
    try:
        dist = tmp / "dist"
        session.run("uv", "build", "--all-packages", "--out-dir", str(dist), external=True)
        constraints = tmp / "constraints.txt"
        session.run(
            "uv", "export", "--frozen", "--no-hashes", "--all-packages", "--all-extras",
            "--no-emit-workspace", "--output-file", str(constraints), "--quiet",
            external=True,
        )  # fmt: skip
        built = _check_wheel_metadata(session, dist, workspace)
        installed = [
            _install_alone(session, tmp, dist, constraints, d, built, workspace, lock) for d in PUBLISHED
        ]
        # The checks import torch in fresh venvs (single-threaded, seconds each): run them side by side.
        with concurrent.futures.ThreadPoolExecutor(SINGLE_PROCESS_WORKERS) as pool:
            checked = list(pool.map(lambda one: _run_installed_check(one, tmp), installed))
        rows = [_check_installed(session, tmp, one, built) for one in checked]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    session.log("each published wheel installed alone (seconds):")
    session.log(f"  {'distribution':<24}{'venv':>6}{'install':>9}{'check':>7}{'dists':>7}  must be absent")
    for row in rows:
        session.log("  {:<24}{:>6.1f}{:>9.1f}{:>7.1f}{:>7}  {}".format(*row))


def _wheel_files(dist: Path) -> dict[str, Path]:
    wheels = {}
    for wheel in sorted(dist.glob("*.whl")):
        wheels[graph.normalize(wheel.name.split("-")[0])] = wheel
    return wheels


def _check_wheel_metadata(
    session: nox.Session, dist: Path, workspace: dict[str, graph.PackageMeta]
) -> dict[str, tuple[Path, str, list[str]]]:
    """Check names, the shared version and sibling bounds; return {dist: (wheel, version, RECORD lines)}."""
    built: dict[str, tuple[Path, str, list[str]]] = {}
    errors = []
    for name, wheel in _wheel_files(dist).items():
        with zipfile.ZipFile(wheel) as zf:
            info = next(n.split("/")[0] for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            metadata = zf.read(f"{info}/METADATA").decode()
            record = zf.read(f"{info}/RECORD").decode().splitlines()
        fields = [line.split(": ", 1) for line in metadata.split("\n\n")[0].splitlines() if ": " in line]
        version = next(v for k, v in fields if k == "Version")
        built[name] = (wheel, version, sorted(line for line in record if ".dist-info/" not in line))
        for key, value in fields:
            if key != "Requires-Dist":
                continue
            req = graph.parse_requirement(value)
            problem = graph.check_sibling_bound(req, version) if req.name in workspace else None
            if problem:
                errors.append(f"{wheel.name}: {problem}")
    if set(built) != set(workspace):
        errors.append(f"built {sorted(built)}, expected one wheel per member {sorted(workspace)}")
    versions = {version for _, version, _ in built.values()}
    if len(versions) != 1:
        errors.append(f"wheels do not share one version: {sorted(versions)}")
    if errors:
        _fail("wheel metadata:\n  " + "\n  ".join(errors))
    session.log(f"{len(built)} wheels, version {versions.pop()}, sibling requirements bounded")
    return built


@dataclass
class _Installed:
    """One published wheel installed alone in a fresh venv, with what its check must see."""

    distribution: str
    venv: Path
    import_name: str
    absent: list[str]
    seconds: list[float]
    """venv creation, install, check."""
    dists: int = 0
    report: dict[str, Any] | None = None

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def _install_alone(
    session: nox.Session,
    tmp: Path,
    dist: Path,
    constraints: Path,
    distribution: str,
    built: dict[str, tuple[Path, str, list[str]]],
    workspace: dict[str, graph.PackageMeta],
    lock: graph.LockGraph,
) -> _Installed:
    """Install one wheel alone in a fresh venv outside the workspace (checked by `_check_installed`)."""
    venv = tmp / f"venv-{distribution}"
    uv = ("uv", "--no-config")
    with session.chdir(tmp):  # so that uv sees no project configuration
        t0 = time.perf_counter()
        session.run(*uv, "venv", "--quiet", "--python", f"{session.bin}/python", str(venv), external=True)
        t1 = time.perf_counter()
        session.run(
            *uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), "--find-links",
            str(dist), "--constraint", str(constraints), str(built[distribution][0]),
            external=True,
        )  # fmt: skip
        t2 = time.perf_counter()
        freeze = session.run(
            *uv,
            "pip",
            "freeze",
            "--python",
            str(venv / "bin" / "python"),
            silent=True,
            external=True,
            log=False,
        )
    absent = graph.expected_absent(distribution, workspace, lock)
    installed = _Installed(
        distribution, venv, workspace[distribution].import_name, absent, [t1 - t0, t2 - t1]
    )
    installed.dists = len(str(freeze).strip().splitlines())
    return installed


def _run_installed_check(installed: _Installed, tmp: Path) -> _Installed:
    """Import the package in its venv, isolated (``-I``), and read what it brought (thread-safe: no nox)."""
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [str(installed.python), "-I", "-c", _INSTALLED_CHECK, installed.import_name, *installed.absent],
        cwd=tmp, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    installed.seconds.append(time.perf_counter() - start)
    if result.returncode != 0:
        name = installed.import_name
        _fail(f"{installed.distribution} installed alone: `import {name}` failed:\n{result.stderr}")
    installed.report = json.loads(result.stdout.strip().splitlines()[-1])
    return installed


def _check_installed(
    session: nox.Session, tmp: Path, installed: _Installed, built: dict[str, tuple[Path, str, list[str]]]
) -> tuple[str, float, float, float, int, str]:
    """Judge an installed wheel's check (and run its README example alone); return its table row."""
    report, distribution, import_name = installed.report, installed.distribution, installed.import_name
    assert report is not None, "the installed check ran first"
    example = _RUN_ALONE.get(distribution)
    if example is not None:
        # What the package's README promises of it alone, run from the fresh venv (gloo, 2 ranks).
        with session.chdir(tmp):
            session.run(
                str(installed.python), "-I", "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", str(ROOT / example), external=True,
                # faulthandler: a native crash in a rank prints every thread's Python stack.
                env={"PYTHONPATH": None, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"},
            )  # fmt: skip
    errors = []
    if not str(report["file"]).startswith(str(installed.venv)):
        errors.append(f"{import_name} imported from {report['file']}, not from the fresh venv")
    version = built[distribution][1]
    if report["version"] is not None and report["version"] != version:
        errors.append(f"{import_name}.__version__ is {report['version']}, the wheel is {version}")
    if report["present"]:
        errors.append(f"importable but not a dependency of {distribution}: {', '.join(report['present'])}")
    missing_scripts = sorted(name for name, present in report["scripts"].items() if not present)
    if missing_scripts:
        errors.append(f"console scripts not installed: {', '.join(missing_scripts)}")
    for name, lines in report["records"].items():
        expected = built.get(graph.normalize(name))
        if expected is None or lines != expected[2]:
            errors.append(f"{name} was not installed from the wheel built by this session")
    if errors:
        _fail(f"{distribution} installed alone:\n  " + "\n  ".join(errors))
    venv_s, install_s, check_s = installed.seconds
    return (distribution, venv_s, install_s, check_s, installed.dists, ", ".join(sorted(installed.absent)))
