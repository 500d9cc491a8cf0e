"""The training loop of a worker: steps, checks every rank agrees on, metrics, evaluation, checkpoints.

Per step (every rank, in this order):

1. the learning rate of the step (warm-up, cosine decay);
2. this rank's rows and the loss normaliser: ``N / dp_cp`` with ``N`` the label tokens of the whole
   global batch (`automodel_all.cli.batches`: known on every rank from the prepared rows, whose order is
   a function of seed and step, or one ``all_reduce`` of the streamed rows' counts);
3. forward and backward over this rank's rows (`run_step`);
4. one ``all_reduce`` (`StepStatus`): the loss, a stop request, NaN/Inf per rank in the loss and the
   gradients; then the global gradient norm (clipped when ``train.max_grad_norm``);
5. a NaN or Inf stops the job on every rank with `NonFiniteError` naming the step and the ranks, or
   (``train.on_nonfinite: skip``) drops the update and counts the step;
6. the optimizer step; the JSON line; evaluation every ``train.eval_every`` steps; a checkpoint every
   ``train.checkpoint_every`` steps (written in the background with ``train.async_checkpoint``), at the
   end, and when a stop signal arrived (then the loop ends; both waited for).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from automodel_all.cli.batches import PreparedBatches, StreamedBatches, stream_spec, streamed_identity
from automodel_all.cli.data import data_folder
from automodel_all.cli.evaluate import evaluate
from automodel_all.cli.export import prune_checkpoints
from automodel_all.cli.guards import NonFiniteError, StepStatus, StopRequest, local_grads_finite
from automodel_all.cli.metrics import MetricsWriter
from automodel_all.cli.model import text_tokenizer
from automodel_all.cli.progress import Progress, memory_gib, warn
from automodel_all.cli.resume import ResumePoint, checkpoint_root, save_checkpoint
from automodel_all.cli.run_state import TrainingRun
from automodel_all.cli.steps import ContextParallelism, clip_gradients, lr_at, run_step
from automodel_all.cli.streaming import StreamSpec

if TYPE_CHECKING:
    from automodel_checkpoint import AsyncCheckpointer

__all__ = ["LoopResult", "data_identity", "open_batches", "train_loop"]


class LoopResult:
    """How the loop ended: ``completed`` or ``preempted`` (with the signal's name)."""

    def __init__(self, outcome: str, step: int, signal_name: str | None = None) -> None:
        self.outcome = outcome
        self.step = step
        self.signal_name = signal_name


def _dp_coordinates(run: TrainingRun) -> tuple[int, int, dist.ProcessGroup | None]:
    """This rank's data-parallel index, the data-parallel size and group (None: the world)."""
    if run.mesh.device_mesh is None:  # DDP: every rank is a data-parallel rank
        return dist.get_rank(), dist.get_world_size(), None
    group = run.mesh.get_group("dp")
    return dist.get_rank(group), run.resolved.dp_size, group


def _stream_spec(run: TrainingRun) -> StreamSpec:
    train = run.job.train
    cache = data_folder(train.output_dir) / "cache"
    return stream_spec(run.job.data, text_tokenizer(run.tokenizer), train.global_batch_size, cache)


def data_identity(run: TrainingRun) -> dict[str, Any]:
    """What a resume compares with a checkpoint's data record (no collective)."""
    train = run.job.train
    if run.rows is not None:
        return PreparedBatches(run.rows, train.global_batch_size, train.seed, 0, 1).position(0)
    return streamed_identity(_stream_spec(run), train.seed)


def open_batches(run: TrainingRun, start: ResumePoint) -> PreparedBatches | StreamedBatches:
    """This rank's steps: the prepared rows, or (``data.streaming``) its streams from ``start``."""
    train = run.job.train
    dp_rank, dp_size, group = _dp_coordinates(run)
    if run.rows is not None:
        return PreparedBatches(run.rows, train.global_batch_size, train.seed, dp_rank, dp_size)
    return StreamedBatches(
        _stream_spec(run),
        text_tokenizer(run.tokenizer),
        seed=train.seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
        group=group,
        first_step=start.step,
        recorded=start.data,
    )


def _expert_load(run: TrainingRun) -> Any:
    """`automodel_moe.ExpertLoad` on every rank for a mixture-of-experts model, else None (collective).

    The ranks agree on the expert count first (one ``all_reduce``): a rank whose pipeline stages hold no
    MoE layer still joins each step's ``summary``.
    """
    import torch

    from automodel_moe import ExpertLoad, find_experts

    counts = {site.num_experts for part in run.parts for site in find_experts(part)}
    agreed = torch.tensor([max(counts, default=0)], dtype=torch.int64, device=run.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    if int(agreed) == 0:
        return None
    return ExpertLoad.attach(run.parts, ep_size=run.mesh.ep_size, num_experts=int(agreed))


def _checkpointer(background: bool, timeout_minutes: float) -> AsyncCheckpointer | None:
    """The background writer of the periodic checkpoints (collective: it makes a gloo group)."""
    from datetime import timedelta

    from automodel_checkpoint import AsyncCheckpointer

    return AsyncCheckpointer(timeout=timedelta(minutes=timeout_minutes)) if background else None


class _Loop:
    """State shared by the steps of one run."""

    def __init__(
        self, run: TrainingRun, start: ResumePoint, stop: StopRequest, metrics: MetricsWriter
    ) -> None:
        job, layout = run.job, run.resolved.layout
        self.run, self.stop = run, stop
        self.train = job.train
        self.rank = dist.get_rank()
        self.data = open_batches(run, start)
        self.dp_rank, self.dp_size, _ = _dp_coordinates(run)
        self.pp_group = run.mesh.get_group("pp") if layout.pp > 1 else None
        self.context_parallel = (
            ContextParallelism(run.mesh, run.job.host_runtime, job.parallelism.cp_ulysses_degree)
            if layout.cp > 1
            else None
        )
        self.tp = layout.tp
        self.dp_cp = layout.dp_cp
        self.params = [p for group in run.optimizer.param_groups for p in group["params"]]
        self.skipped = start.skipped_steps
        self.metrics = metrics
        self.checkpointer = _checkpointer(self.train.async_checkpoint, job.launch.timeout_minutes)
        self.experts = _expert_load(run)
        fp8 = job.fp8
        self.precompute_fp8 = fp8 is not None and fp8.enabled and fp8.precompute_float8_dynamic_scale_for_fsdp
        self.world = dist.get_world_size()
        self.synced = time.perf_counter()
        self.utilization = run.utilization
        self.progress = Progress(
            total=self.train.steps, initial=start.step, enabled=self.rank == 0, device=run.device
        )

    # ------------------------------------------------------------------------------------ one step

    def step(self, step: int) -> tuple[dict[str, Any], bool]:
        """Train step ``step`` (0-based); returns its log record and whether a stop was requested."""
        run, train = self.run, self.train
        began = time.perf_counter()
        lr = lr_at(
            step,
            lr=train.lr,
            warmup_steps=train.warmup_steps,
            total_steps=train.steps,
            min_lr_ratio=train.min_lr_ratio,
        )
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        rows = self.data.step(step, run.device)
        labels, tokens = rows.labels, rows.tokens
        run.loss_fn.denominator = max(labels, 1) / self.dp_cp
        local = run_step(
            run.model if run.pipeline is None else None,
            rows.batch,
            loss_fn=run.loss_fn,
            micro_batch_size=train.micro_batch_size,
            strategy=run.strategy,
            pipeline=run.pipeline,
            context_parallel=self.context_parallel,
        )
        grads_finite = local_grads_finite(self.params)  # its host sync: the backward has finished here
        status = StepStatus.agree(
            local,
            stop=self.stop.requested,
            grads_finite=grads_finite,
            device=run.device,
            seconds=time.perf_counter() - self.synced,
        )
        # Every rank leaves the agreement together: the common start of the next step's timing.
        self.synced = time.perf_counter()
        grad_norm = clip_gradients(self.params, train.max_grad_norm, self.pp_group)
        done = step + 1
        skipped = False
        if not (status.finite and math.isfinite(grad_norm)):
            problem = status.describe(done, None if math.isfinite(grad_norm) else grad_norm)
            if train.on_nonfinite == "error":
                raise NonFiniteError(
                    f"{problem}. Stopping before the update, so the weights and the last checkpoint stay "
                    "finite; lower train.lr, check the data, or set train.on_nonfinite: skip"
                )
            skipped = True
            self.skipped += 1
            if self.rank == 0:
                warn(f"{problem}: skipped (no update), {self.skipped} step(s) skipped so far")
        else:
            run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        if self.precompute_fp8 and not skipped:
            from automodel_quant.fp8 import precompute_fp8_scales_for_fsdp

            for part in run.parts:
                precompute_fp8_scales_for_fsdp(part)
        elapsed = time.perf_counter() - began
        loss = status.loss_sum / (max(labels, 1) * self.tp) if not status.bad_loss else float("nan")
        record: dict[str, Any] = {
            "step": done,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": labels,
            "tokens_per_s": tokens / elapsed,
            **self.utilization.of_step(tokens / elapsed, self.world),
            "seconds": elapsed,
            "slowest_rank": status.slowest_rank,
            "slowest_seconds": status.slowest_seconds,
            "memory_gib": memory_gib(run.device),
            "skipped": skipped,
            "skipped_total": self.skipped,
        }
        if self.experts is not None:
            record["moe"] = self.experts.summary()
        return record, status.stop

    # ----------------------------------------------------------------------------- eval, checkpoint

    def evaluate(self, done: int) -> None:
        run = self.run
        if run.eval_rows is None:
            return
        if self.experts is not None:
            self.experts.active = False
        per_forward = (
            run.resolved.rows_per_dp_rank if run.pipeline is not None else self.train.micro_batch_size
        )
        result = evaluate(
            run.model if run.pipeline is None else None,
            run.eval_rows,
            loss_fn=run.loss_fn,
            strategy=run.strategy,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            rows_per_forward=per_forward,
            tp_size=self.tp,
            device=run.device,
            pipeline=run.pipeline,
            context_parallel=self.context_parallel,
        )
        if self.experts is not None:
            self.experts.active = True
        self.metrics.evaluation({"step": done, **result})
        if self.rank == 0:
            self.progress.write(
                f"step {done}: eval loss {result['eval_loss']:.4f}, perplexity {result['eval_ppl']:.2f} "
                f"({result['eval_tokens']} tokens)"
            )

    def checkpoint(self, done: int, reason: str) -> None:
        run = self.run
        save_checkpoint(
            run.state_module,
            run.optimizer,
            run.out,
            step=done,
            data=self.data.position(done),
            skipped_steps=self.skipped,
            reason=reason,
            device=run.device,
            checkpointer=self.checkpointer,
            hf_weights=self.train.hf_checkpoints,
            parts=run.parts,
        )
        if self.rank == 0:  # the newest complete ones are kept: never the one still in flight
            prune_checkpoints(checkpoint_root(run.out), self.train.keep_checkpoints)
        dist.barrier()

    # ------------------------------------------------------------------------------------------ run

    def run_from(self, start: int) -> LoopResult:
        train = self.train
        try:
            for step in range(start, train.steps):
                record, stop = self.step(step)
                done = step + 1
                self.metrics.step(record)
                self.progress.update(
                    loss=record["loss"], tokens_per_s=record["tokens_per_s"], mfu=record["mfu"]
                )
                last = done == train.steps
                if stop and not last:  # preempted: the checkpoint first, within the launcher's grace period
                    self.checkpoint(done, "preempted")
                    name = (
                        self.stop.signal.name
                        if self.stop.signal is not None
                        else "a stop signal on another rank"
                    )
                    return LoopResult("preempted", done, name)
                if last or (train.eval_every and done % train.eval_every == 0):
                    self.evaluate(done)
                if last or (train.checkpoint_every and done % train.checkpoint_every == 0):
                    self.checkpoint(done, "final" if last else "periodic")
            if start >= train.steps and self.run.eval_rows is not None:
                self.evaluate(start)
            return LoopResult("completed", max(start, train.steps))
        finally:
            try:
                if self.checkpointer is not None:
                    self.checkpointer.close()  # a failed background write raises here at the latest
            finally:
                self.progress.close()


def train_loop(run: TrainingRun, start: ResumePoint, stop: StopRequest, metrics: MetricsWriter) -> LoopResult:
    """Train from ``start.step`` to ``train.steps`` (collective; see the module docstring).

    ``metrics`` gets every step's and evaluation's record; the caller closes it.
    """
    return _Loop(run, start, stop, metrics).run_from(start.step)
