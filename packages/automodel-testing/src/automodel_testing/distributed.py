"""Run a function on N real ``torch.distributed`` ranks from inside a test, and never hang.

`run_distributed` starts one process per rank, gives each a real default process group (``gloo`` on
CPU, ``nccl`` on CUDA) and collects the return values. A rank that raises, dies or hangs turns into a
`DistributedRunError` that carries every failing rank's traceback.

Ranks are forked from a ``forkserver`` that has imported torch and transformers once (`PRELOAD`), not
spawned: a spawned rank spends seconds importing them, every launch, and a test run makes hundreds of
launches. The server is a clean single-purpose process (it only imported modules), so each rank still
starts from the same state, with the caller's environment and working directory at launch.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.process import BaseProcess
from queue import Empty
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from automodel_testing._launch import (
    STACKS_SIGNAL,
    LaunchSpec,
    rank_environment,
    rank_output_path,
    resolve_function_ref,
    worker_main,
)

if TYPE_CHECKING:
    import pytest

__all__ = ["PRELOAD", "DistributedRunError", "available_gpus", "run_distributed", "skip_unless_gpus"]

T = TypeVar("T")

_DEFAULT_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
_RESERVED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
_FAILURE_GRACE_S = 5.0  # after the first failure, how long the other ranks get to report or exit
_EXIT_GRACE_S = 15.0  # after every rank returned, how long they get to exit
_KILL_WAIT_S = 2.0  # how long SIGTERM gets before SIGKILL
_POLL_S = 0.05
_OUTPUT_TAIL_LINES = 60  # of a rank's output, quoted in the error when it ended without a report
_STACKS_WAIT_S = 1.0  # how long a hung rank gets to write its stacks before it is stopped
PRELOAD: tuple[str, ...] = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "torch._dynamo",
    "transformers",
    "transformers.modeling_utils",
)
"""Modules the fork server imports once for every rank it forks (a missing one is skipped).

Only third-party modules whose import has no side effect a rank could depend on: reading the
environment at import time would see the server's, not the launch's."""


class DistributedRunError(AssertionError):
    """One or more ranks of a `run_distributed` call failed, died or did not finish in time.

    It subclasses `AssertionError` so that pytest reports it as a test failure.

    Attributes:
        failures: Rank -> what went wrong (a formatted traceback, or a description of the exit).
        unfinished: Ranks that were still running when they were terminated.
    """

    def __init__(
        self, message: str, failures: Mapping[int, str] | None = None, unfinished: Sequence[int] = ()
    ) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})
        self.unfinished: list[int] = list(unfinished)


def available_gpus() -> int:
    """Number of visible CUDA devices, without creating a CUDA context in this process."""
    return int(torch.cuda.device_count())


def skip_unless_gpus(n: int) -> pytest.MarkDecorator:
    """A ``pytest.mark.skipif`` that skips a test when fewer than ``n`` CUDA devices are visible.

    Args:
        n: Number of CUDA devices the test needs (at least 1).

    Returns:
        The marker; its reason reads ``"needs N CUDA devices, found M"``.

    Raises:
        ValueError: If ``n`` is smaller than 1.
    """
    import pytest

    if n < 1:
        raise ValueError(f"skip_unless_gpus needs n >= 1, got {n}")
    found = available_gpus()
    return pytest.mark.skipif(found < n, reason=f"needs {n} CUDA devices, found {found}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def _patched_environ(updates: Mapping[str, str]) -> Iterator[None]:
    """Set variables in this process's environment for the duration of a ``Process.start()``.

    The first start also starts the fork server, which inherits this environment: its torch import
    then sees ``OMP_NUM_THREADS=1``, as every rank's would.
    """
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_UNIX_PATH_MAX = 107  # the fork server listens on a socket in the temporary folder (sun_path)


def _context(start_method: str) -> Any:
    """The context for ``start_method``; ``forkserver``'s server preloads `PRELOAD`.

    A temporary folder too deep for a Unix socket path (the server listens on one there) falls back
    to ``spawn``.
    """
    if start_method == "forkserver" and len(tempfile.gettempdir()) + 40 > _UNIX_PATH_MAX:
        start_method = "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # the server skips a module it cannot import
    return ctx


def _validate(
    world_size: int,
    device: str,
    timeout_s: float,
    pg_timeout_s: float,
    env: Mapping[str, str] | None,
    start_method: str,
) -> None:
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(
            f"run_distributed: start_method must be 'forkserver' or 'spawn', got {start_method!r}"
        )
    if start_method == "forkserver" and "LD_PRELOAD" in (env or {}):
        raise ValueError(
            "run_distributed: env={'LD_PRELOAD': ...} acts only when an interpreter starts, and forked "
            "ranks do not start one: pass start_method='spawn'"
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_distributed needs world_size >= 1, got {world_size!r}")
    if device not in _DEFAULT_BACKENDS:
        raise ValueError(
            f"run_distributed: device must be one of {sorted(_DEFAULT_BACKENDS)}, got {device!r}"
        )
    if timeout_s <= 0 or pg_timeout_s <= 0:
        raise ValueError(f"run_distributed: timeouts must be > 0, got {timeout_s=} and {pg_timeout_s=}")
    if device == "cuda" and (found := available_gpus()) < world_size:
        raise ValueError(
            f"run_distributed: world_size={world_size} on cuda needs {world_size} CUDA devices, found "
            f"{found}; skip the test before calling (see skip_unless_gpus)."
        )
    reserved = sorted(set(env or {}) & set(_RESERVED_ENV))
    if reserved:
        raise ValueError(f"run_distributed sets {reserved} per rank itself; remove them from env=")
    bad = {key: value for key, value in (env or {}).items() if not isinstance(value, str)}
    if bad:
        raise ValueError(f"run_distributed: env values must be strings, got {bad!r}")


def _shared_env(world_size: int, env: Mapping[str, str] | None) -> dict[str, str]:
    base = {
        "OMP_NUM_THREADS": "1",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    return {**os.environ, **base, **(env or {})}


def _describe_end(code: int | None, was_running: bool) -> str:
    """How a rank ended: its exit, or how it was stopped when it was still running."""
    if code is None:
        return "still running"
    if was_running:
        return f"still running, stopped ({_describe_exit(code)})"
    return _describe_exit(code)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class _Monitor:
    """Collects the ranks' reports while watching their processes; decides when to stop waiting."""

    def __init__(self, procs: Sequence[BaseProcess], queue: Any, timeout_s: float) -> None:
        self.procs = procs
        self.queue = queue
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.results: dict[int, bytes] = {}
        self.errors: dict[int, str] = {}
        self.failure_order: list[int] = []
        self.first_failure_at: float | None = None
        self.all_returned_at: float | None = None
        self.timed_out = False

    def _receive(self, timeout: float | None) -> bool:
        try:
            kind, rank, value = self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()
        except Empty:
            return False
        if kind == "ok":
            self.results[rank] = value
        else:
            self.errors[rank] = value
            self._note_failure(rank)
        return True

    def _drain(self, timeout: float) -> None:
        if self._receive(timeout):
            while self._receive(None):
                pass

    def _note_failure(self, rank: int) -> None:
        if rank not in self.failure_order:
            self.failure_order.append(rank)
        if self.first_failure_at is None:
            self.first_failure_at = time.monotonic()

    def _check_exits(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is None or rank in self.failure_order:
                continue
            if rank not in self.results and rank not in self.errors:
                self._drain(0.0)  # its last message may still sit in the pipe
            if rank in self.results and proc.exitcode == 0:
                continue
            if rank not in self.errors:
                self._note_failure(rank)

    def wait(self) -> None:
        """Block until every rank returned and exited, a failure settled, or the deadline passed."""
        n = len(self.procs)
        while True:
            self._drain(_POLL_S)
            self._check_exits()
            now = time.monotonic()
            exited = all(proc.exitcode is not None for proc in self.procs)
            if self.first_failure_at is not None:
                if exited or now - self.first_failure_at > _FAILURE_GRACE_S or now > self.deadline:
                    return
            elif len(self.results) == n:
                if exited:
                    return
                self.all_returned_at = self.all_returned_at or now
                if now - self.all_returned_at > _EXIT_GRACE_S:
                    return
            elif now > self.deadline:
                self.timed_out = True
                return

    def unfinished(self) -> list[int]:
        return [rank for rank, proc in enumerate(self.procs) if proc.exitcode is None]

    def succeeded(self) -> bool:
        return not self.failure_order and not self.timed_out and not self.unfinished()

    def failure_message(
        self,
        title: str,
        unfinished: Sequence[int],
        exit_codes: Sequence[int | None],
        outputs: Sequence[str],
    ) -> str:
        first = self.failure_order[0] if self.failure_order else None
        if self.timed_out:
            headline = (
                f"{title} timed out after {self.timeout_s:g} s; ranks {list(unfinished)} did not finish."
            )
        elif first is not None:
            headline = f"{title} failed; first failure on rank {first}."
        else:
            headline = (
                f"{title}: ranks {list(unfinished)} returned but did not exit within {_EXIT_GRACE_S:g} s."
            )
        lines = [headline]
        for rank, code in enumerate(exit_codes):
            report = "raised" if rank in self.errors else "returned" if rank in self.results else "no report"
            if report == "no report" and rank in self.failure_order:
                report += " (its output ends below)"
            lines.append(f"  rank {rank}: {report}; {_describe_end(code, rank in unfinished)}")
        for rank in dict.fromkeys([*self.failure_order, *unfinished]):
            if rank in self.errors:
                lines.append(f"----- rank {rank} traceback -----\n{self.errors[rank].rstrip()}")
            elif outputs[rank].strip():
                tail = "\n".join(outputs[rank].rstrip().splitlines()[-_OUTPUT_TAIL_LINES:])
                lines.append(f"----- rank {rank} output (last {_OUTPUT_TAIL_LINES} lines) -----\n{tail}")
        return "\n".join(lines)

    def failures(self, exit_codes: Sequence[int | None], unfinished: Sequence[int]) -> dict[int, str]:
        out: dict[int, str] = {}
        for rank in self.failure_order:
            out[rank] = self.errors.get(rank) or _describe_end(exit_codes[rank], rank in unfinished)
        for rank in unfinished:
            out.setdefault(rank, _describe_end(exit_codes[rank], True))
        return out


def _signal_all(procs: Sequence[BaseProcess], sig: signal.Signals) -> None:
    for proc in procs:
        if proc.exitcode is not None or proc.pid is None:
            continue
        try:
            if os.getpgid(proc.pid) == proc.pid:  # the rank made itself a group leader
                os.killpg(proc.pid, sig)
            else:
                os.kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _dump_stacks(procs: Sequence[BaseProcess]) -> None:
    """Ask each of ``procs`` (ranks still running) to write its threads' Python stacks to its output."""
    for proc in procs:
        if proc.exitcode is None and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, STACKS_SIGNAL)
    if procs:
        time.sleep(_STACKS_WAIT_S)


def _stop_all(procs: Sequence[BaseProcess]) -> None:
    """SIGTERM every live rank (with the processes it started), then SIGKILL what is left."""
    _signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_WAIT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    _signal_all(procs, signal.SIGKILL)
    for proc in procs:
        proc.join()


def run_distributed(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    device: str = "cpu",
    backend: str | None = None,
    timeout_s: float = 180.0,
    pg_timeout_s: float = 30.0,
    env: Mapping[str, str] | None = None,
    init_process_group: bool = True,
    start_method: str = "forkserver",
    device_audit: bool = True,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks and return their results.

    Each rank is a fresh process forked from the fork server (see the module docstring), with this
    process's environment plus ``OMP_NUM_THREADS=1`` (and ``torch.set_num_threads``), ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a free
    ``MASTER_PORT`` and ``env``, in this process's working directory. Unless
    ``init_process_group`` is False, it joins a default process group through a file rendezvous in
    a temporary folder (with ``device="cuda"``, after ``torch.cuda.set_device(rank)``); the group is
    destroyed when ``fn`` returns, whoever created it.

    ``fn`` must be a module-level function; it may live in a pytest test module collected with
    ``--import-mode=importlib`` (the rank imports that module from its file). ``args``, ``kwargs`` and
    the return values must be picklable. Keyword arguments named like this function's own parameters
    go to this function, not to ``fn``.

    Args:
        fn: Module-level function to run on every rank.
        world_size: Number of ranks (>= 1).
        *args: Positional arguments for ``fn``.
        device: ``"cpu"`` or ``"cuda"``.
        backend: Process-group backend; defaults to ``gloo`` on cpu and ``nccl`` on cuda.
        timeout_s: Wall-clock limit for the whole run, start-up included.
        pg_timeout_s: Timeout of the process group's collectives.
        env: Extra environment variables for every rank (may override ``OMP_NUM_THREADS`` and
            ``MASTER_*``, not the rank variables).
        init_process_group: Whether to create the default process group before calling ``fn``.
        start_method: ``"forkserver"`` (fast: the ranks are forked from a server that imported
            `PRELOAD`) or ``"spawn"`` (a fresh interpreter per rank, for ``env`` that must be in place
            when the interpreter starts, such as ``LD_PRELOAD``).
        device_audit: Run ``fn`` under `automodel_testing.device_audit.implicit_device_audit`: a
            tensor that automodel library code creates without ``device=`` fails the rank, as it
            would misplace the tensor on a GPU job. On by default.
        **kwargs: Keyword arguments for ``fn``.

    Returns:
        The ranks' return values, indexed by rank.

    Raises:
        ValueError: For a bad ``world_size``, device, timeout or ``env``; for ``device="cuda"`` with
            fewer GPUs than ranks; for a lambda or nested ``fn``; for unpicklable arguments.
        DistributedRunError: If a rank raised, died, hung past ``timeout_s`` or did not exit. After
            the first failure the other ranks get a few seconds to report, then every rank still
            running is terminated (SIGTERM, then SIGKILL).
    """
    _validate(world_size, device, timeout_s, pg_timeout_s, env, start_method)
    ref = resolve_function_ref(fn)
    try:
        payload = pickle.dumps((args, kwargs))
    except Exception as exc:
        raise ValueError(
            f"run_distributed: the arguments for {ref.qualname} cannot be pickled: {exc}"
        ) from exc
    title = f"run_distributed({ref.module_name}.{ref.qualname}, world_size={world_size}, device={device!r})"
    tmpdir = tempfile.mkdtemp(prefix="automodel-run-distributed-")
    spec = LaunchSpec(
        fn_ref=ref,
        payload=payload,
        world_size=world_size,
        device=device,
        backend=backend or _DEFAULT_BACKENDS[device],
        init_method=f"file://{tmpdir}/rendezvous",
        pg_timeout_s=pg_timeout_s,
        init_process_group=init_process_group,
        env=_shared_env(world_size, env),
        cwd=os.getcwd(),
        device_audit=device_audit,
        output_dir=tmpdir,
    )
    ctx = _context(start_method)
    queue = ctx.Queue()
    procs: list[BaseProcess] = []
    try:
        monitor = _Monitor(procs, queue, timeout_s)
        for rank in range(world_size):
            proc = ctx.Process(
                target=worker_main, args=(rank, spec, queue), name=f"run_distributed-rank{rank}"
            )
            with _patched_environ(rank_environment(spec, rank)):
                proc.start()
            procs.append(proc)
        monitor.wait()
        if monitor.succeeded():
            return _unpickle_results(monitor.results, world_size, title)
        unfinished = monitor.unfinished()
        _dump_stacks([procs[rank] for rank in unfinished])
        _stop_all(procs)
        exit_codes = [proc.exitcode for proc in procs]
        outputs = [_read_output(tmpdir, rank) for rank in range(world_size)]
        raise DistributedRunError(
            monitor.failure_message(title, unfinished, exit_codes, outputs),
            failures=monitor.failures(exit_codes, unfinished),
            unfinished=unfinished,
        )
    finally:
        _stop_all(procs)
        queue.close()
        _replay_output(tmpdir, len(procs))
        shutil.rmtree(tmpdir, ignore_errors=True)


def _read_output(folder: str, rank: int) -> str:
    """What rank ``rank`` wrote to its stdout and stderr (empty when it wrote nothing)."""
    try:
        with open(rank_output_path(folder, rank), encoding="utf-8", errors="replace") as file:
            return file.read()
    except FileNotFoundError:
        return ""


def _replay_output(folder: str, world_size: int) -> None:
    """Write each rank's output to this process's stderr, where the caller (a pytest capture) sees it."""
    for rank in range(world_size):
        output = _read_output(folder, rank)
        if output:
            sys.stderr.write(f"----- run_distributed rank {rank} output -----\n{output}")
            if not output.endswith("\n"):
                sys.stderr.write("\n")
    sys.stderr.flush()


def _unpickle_results(results: Mapping[int, bytes], world_size: int, title: str) -> list[Any]:
    values: list[Any] = []
    for rank in range(world_size):
        try:
            values.append(pickle.loads(results[rank]))
        except Exception as exc:
            raise DistributedRunError(
                f"{title}: the result of rank {rank} cannot be unpickled here: {exc!r}", {rank: repr(exc)}
            ) from exc
    return values
