"""Activation memory per rank, measured from the model's own forward on fake tensors (no memory used).

`profile_activations` runs the causal LM's forward and loss once under ``FakeTensorMode`` (shapes and
dtypes only, the real widths) with a ``saved_tensors_hooks`` pack hook, so every tensor autograd keeps
for backward is seen exactly as a real step would keep it (the attention kernel, the norms' fp32 copies,
the logits' upcast). Each saved tensor is attributed to the transformer block running when it was saved
(`find_transformer_blocks`) or to the rest of the model (embedding, final norm, head, loss), and
classified, from the model's tensor-parallel plan (`resolve_tp_plan`), as *boundary* (the hidden states
entering a column-parallel layer, norms, residuals: replicated over ``tp`` unless sequence parallel) or
*interior* (between a column- and a row-parallel layer: sharded over ``tp``). A dispatch mode records
which op produced each tensor so that selective checkpointing's save list
(`SELECTIVE_AC_ALWAYS_SAVE_OPS`, every other `SELECTIVE_AC_MATMUL_OPS` op) can be applied to the
profile. `activation_bytes` then combines a profile with a checkpointing mode and the number of
micro-batches a pipeline rank holds at once.

No process group, no mesh axes: pure functions of the model config and the sizes given. Where
transformers treats a fake tensor as tracing, it takes its traceable path (a few more saved tensors;
in older releases an explicit causal mask too), so the profile errs a few percent high against an
eager forward (``tests/unit/test_activations.py`` bounds it at 10%). Without a padding mask the
transformers this workspace locks calls SDPA with ``is_causal``, as on a GPU: no ``s x s`` mask. SDPA
calls the CPU would compute by its math path run in the kernel a GPU takes (`CudaSdpaChoice`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from automodel_distributed.blocks import find_transformer_blocks
from automodel_modules import embedding_module
from automodel_planner.compute import ComputeProfile, ComputeRecorder, SelectiveCount
from automodel_planner.repeated_blocks import repeated_blocks, skip_repeated
from automodel_planner.sdpa_choice import CudaSdpaChoice, profiled_attention, unpacked_rows

__all__ = [
    "ActivationProfile",
    "BlockActivations",
    "FakeModel",
    "StepProfile",
    "activation_bytes",
    "build_fake_model",
    "held_per_microbatch",
    "profile_activations",
    "profile_step",
]

Checkpointing = Literal[False, "full", "selective"]


@dataclass(frozen=True)
class BlockActivations:
    """Bytes one transformer block saves for backward, per micro-batch, on one rank (before TP/SP)."""

    boundary: int
    """Hidden-state-wide tensors (norm inputs and outputs, column-parallel inputs, residuals)."""
    interior: int
    """Tensors between a column- and a row-parallel layer (heads, the MLP's inner width)."""
    selective_boundary: int
    """The part of ``boundary`` that selective checkpointing keeps."""
    selective_interior: int
    """The part of ``interior`` that selective checkpointing keeps."""
    input_bytes: int
    """The block's input hidden states (what full checkpointing keeps)."""

    def total(self, tp: int, sequence_parallel: bool) -> int:
        """Saved bytes on one of ``tp`` ranks."""
        return self.boundary // (tp if sequence_parallel else 1) + self.interior // tp

    def kept(self, tp: int, sequence_parallel: bool) -> int:
        """Bytes selective checkpointing keeps on one of ``tp`` ranks (the block input included)."""
        sp = tp if sequence_parallel else 1
        return (self.selective_boundary + self.input_bytes) // sp + self.selective_interior // tp


@dataclass(frozen=True)
class ActivationProfile:
    """What one micro-batch's forward saves, from `profile_activations`."""

    blocks: tuple[BlockActivations, ...]
    """One entry per transformer block, in forward order."""
    head: int
    """Bytes saved outside the blocks by the last pipeline stage: final norm, LM head, logits, loss."""
    embedding: int
    """Bytes saved outside the blocks by the first pipeline stage (the embedding's indices)."""
    largest_head_tensor: int
    """The largest single tensor saved outside the blocks (the logits or their fp32 copy): its
    gradient exists alongside it at the start of backward."""
    tokens: int
    """Tokens per micro-batch on one rank (micro-batch x sequence length / cp)."""
    head_vocab: int = 0
    """Of ``head``, the tensors as wide as the vocabulary (the logits, their fp32 copy, the
    log-softmax): tensor parallelism's vocab-sharded head and `MaskedCrossEntropy`'s vocabulary-parallel
    loss keep them sharded over ``tp``."""
    largest_is_vocab: bool = False
    """Whether ``largest_head_tensor`` is one of those."""
    logits: int = 0
    """Bytes of the LM head's output (the logits in the compute dtype)."""

    def head_bytes(self, tp: int, compiled_loss: bool = False) -> int:
        """Bytes the last stage saves outside the blocks on one of ``tp`` ranks (largest's gradient too).

        A compiled loss (``compiled_loss``, unsharded logits: ``tp == 1``) keeps the logits in their own
        dtype instead of the vocabulary-wide fp32 tensors an eager loss saves, and makes their gradient
        in that dtype (`automodel_distributed.loss.MaskedCrossEntropy`'s ``compiled``); under ``tp``
        the vocabulary-parallel loss stays eager.
        """
        if compiled_loss and tp == 1:
            return self.head - self.head_vocab + 2 * self.logits
        vocab_shards = tp if self.largest_is_vocab else 1
        return self.head - self.head_vocab + self.head_vocab // tp + self.largest_head_tensor // vocab_shards


class _Producers(torch.utils._python_dispatch.TorchDispatchMode):
    """Sums, per block, the outputs that selective checkpointing saves (attention, every other matmul)."""

    def __init__(self, classify: Callable[[bool], tuple[int, str]]) -> None:
        super().__init__()
        self.classify = classify
        self.selective = SelectiveCount()
        self.kept: dict[tuple[int, str], int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.selective.saves(str(func)):
            block, kind = self.classify(True)
            if block >= 0:
                for tensor in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(tensor, torch.Tensor):
                        size = tensor.numel() * tensor.element_size()
                        self.kept[(block, kind)] = self.kept.get((block, kind), 0) + size
        return out


def _causal_lm(model_config: Any, dtype: torch.dtype, attn_implementation: str | None) -> nn.Module:
    """The causal LM of ``model_config`` built on the active device (config kept).

    A vision-language config is profiled by its language model (``get_text_config()``): image tokens
    count as text tokens, and the vision tower's own activations are not modelled. Where transformers
    maps the text config to no causal-LM class (Qwen2.5-VL's text config has none), the whole
    image-text-to-text model is built and runs on text alone: its tower's blocks save nothing.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.initialization import no_init_weights
    from transformers.models.auto.auto_factory import _get_model_class  # the class from_config builds
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # None: transformers' own default, as the trainer builds the model (SDPA where the family supports
    # it, else its eager attention).
    get_text = getattr(model_config, "get_text_config", None)
    text = get_text() if callable(get_text) else model_config
    whole = text is not model_config and text.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    config = copy.deepcopy(model_config if whole else text)
    auto = AutoModelForImageTextToText if whole else AutoModelForCausalLM
    requested = attn_implementation or getattr(model_config, "_attn_implementation", None)
    implementation = profiled_attention(requested, _get_model_class(config, auto._model_mapping))
    config.use_cache = False
    if whole:
        config.get_text_config().use_cache = False
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # dtype given: a config that once built a model remembers that model's dtype (fp32 master
        # weights), while the profile is of the compute dtype. Fake values need no initialisation
        # (transformers' own switch skips its per-module init walk too).
        with no_init_weights():
            return auto.from_config(config, attn_implementation=implementation, dtype=dtype)
    finally:
        torch.set_default_dtype(previous)


class _Recorder:
    """Attributes each tensor saved for backward to the block running and to boundary or interior.

    Hooks on every module track where the forward is (``scope``) and which block runs (``block``);
    `pack` is the ``saved_tensors_hooks`` pack hook. Lives only inside one fake forward.
    """

    def __init__(self, model: nn.Module, blocks: list[tuple[str, nn.Module]], styles: dict[str, str]) -> None:
        self.styles = styles
        self.names = {module: fqn for fqn, module in model.named_modules()}
        self.parameters = {p.untyped_storage()._cdata for p in model.parameters()}
        prefixes = tuple(fqn + "." for fqn, _ in blocks)
        # Modules inside a block that hold a sharded layer (attention, MLP): what they compute between
        # their column- and row-parallel layers is sharded over tp.
        self.plan_parents = tuple(
            {fqn.rsplit(".", 1)[0] for fqn in styles if fqn.rsplit(".", 1)[0].startswith(prefixes)}
        )
        get_head = getattr(model, "get_output_embeddings", None)
        self.head_module = get_head() if callable(get_head) else None
        self.vocab = getattr(self.head_module, "out_features", None)
        self.logits = 0
        embeddings = embedding_module(model, "input")
        self.embed_fqn = self.names.get(embeddings, "\0") if embeddings is not None else "\0"
        self.scope: list[str] = []
        self.block = -1
        self.saved: dict[int, tuple[int, str, int]] = {}  # storage -> (block, kind, bytes)
        self.alive: list[Any] = []
        self.inputs: dict[int, int] = {}
        self.producers = _Producers(self.classify)

    def classify(self, op_output: bool = False) -> tuple[int, str]:
        """(block, kind) of a tensor made now: ``embedding``, ``boundary`` or ``interior``."""
        where = self.scope[-1] if self.scope else ""
        style = self.styles.get(where)
        if self.block < 0 and (where == self.embed_fqn or where.startswith(self.embed_fqn + ".")):
            return self.block, "embedding"
        if style is not None:
            # A column-parallel layer saves its full input and outputs a shard; a row-parallel layer
            # saves its sharded input and outputs full-size partial sums.
            return self.block, "interior" if (style == "colwise") == op_output else "boundary"
        inside = any(where == p or where.startswith(p + ".") for p in self.plan_parents)
        return self.block, "interior" if inside else "boundary"

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """The pack hook: record a tensor saved for backward (once per storage, parameters excluded)."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self.parameters and key not in self.saved:
            block, kind = self.classify()
            if block < 0 and kind != "embedding" and tensor.ndim and tensor.shape[-1] == self.vocab:
                kind = "vocab"
            self.saved[key] = (block, kind, storage.nbytes())
            # Kept alive so that no later storage reuses the key: the blocks `repeated_blocks` skips
            # return new leaf tensors, which cut the graph that would otherwise keep it alive.
            self.alive.append(storage)
        return tensor

    def hooks(self, model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[Any]:
        """Register the tracking hooks; returns their handles."""
        handles = []
        for fqn, module in model.named_modules():
            if fqn:
                handles.append(module.register_forward_pre_hook(self._push))
                handles.append(module.register_forward_hook(self._pop))
        for index, (_fqn, block) in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(partial(self._enter, index), with_kwargs=True))
            handles.append(block.register_forward_hook(self._leave))
        if isinstance(self.head_module, nn.Module):
            handles.append(self.head_module.register_forward_hook(self._logits))
        return handles

    def _logits(self, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            self.logits = output.numel() * output.element_size()

    def _push(self, module: nn.Module, args: Any) -> None:
        self.scope.append(self.names[module])

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        self.scope.pop()

    def _enter(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.block = index
        self.producers.selective.start_block()
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor):
            self.inputs[index] = hidden.numel() * hidden.element_size()

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.block = -1

    def profile(self, num_blocks: int, tokens: int, copies: Mapping[int, int]) -> ActivationProfile:
        """The recorded bytes as a profile; each block of ``copies`` (it did not run) takes its source's."""
        per_block = [[0, 0] for _ in range(num_blocks)]
        head = head_vocab = embedding = largest = 0
        largest_is_vocab = False
        for index, kind, size in self.saved.values():
            if index >= 0:
                per_block[index][0 if kind == "boundary" else 1] += size
            elif kind == "embedding":
                embedding += size
            else:
                head += size
                head_vocab += size if kind == "vocab" else 0
                if size > largest:
                    largest, largest_is_vocab = size, kind == "vocab"
        kept = dict(self.producers.kept)
        for index, source in copies.items():
            per_block[index] = list(per_block[source])
            for kind in ("boundary", "interior"):
                kept[(index, kind)] = kept.get((source, kind), 0)
        return ActivationProfile(
            blocks=tuple(
                BlockActivations(
                    boundary=b,
                    interior=i,
                    selective_boundary=kept.get((n, "boundary"), 0),
                    selective_interior=kept.get((n, "interior"), 0),
                    input_bytes=self.inputs.get(n, 0),
                )
                for n, (b, i) in enumerate(per_block)
            ),
            head=head,
            embedding=embedding,
            largest_head_tensor=largest,
            tokens=tokens,
            head_vocab=head_vocab,
            largest_is_vocab=largest_is_vocab,
            logits=self.logits,
        )


def _where(recorder: _Recorder, blocks: list[tuple[str, nn.Module]]) -> tuple[int, str]:
    """(block running or -1, the innermost module's name: inside its block, else in the model)."""
    fqn = recorder.scope[-1] if recorder.scope else ""
    if recorder.block >= 0:
        prefix = blocks[recorder.block][0]
        return recorder.block, fqn[len(prefix) + 1 :] if fqn.startswith(prefix + ".") else ""
    return -1, fqn


@dataclass(frozen=True)
class StepProfile:
    """What one micro-batch's forward saves (`ActivationProfile`) and computes (`ComputeProfile`)."""

    activations: ActivationProfile
    compute: ComputeProfile


@dataclass(frozen=True)
class FakeModel:
    """A causal LM built once for `profile_step`, which runs it at several shapes under ``mode``.

    Built on the meta device; the parameters and buffers a profile reads (outside the blocks, and in the
    blocks that run: two of each kind, `repeated_blocks`) are then fake tensors of ``mode``, the rest
    stay on meta until a profile runs every block. A 405B Llama's 126 blocks are built in a fraction of
    the time fake parameters for all of them take, and a planner trying many layouts profiles a handful
    of shapes of one model.
    """

    mode: Any
    model: nn.Module
    dtype: torch.dtype
    attn_implementation: str | None


def build_fake_model(
    model_config: Any, dtype: torch.dtype, attn_implementation: str | None = None
) -> FakeModel:
    """The causal LM of ``model_config``, fake tensors of ``dtype`` where a profile runs (config untouched).

    Built on the meta device, as the trainer builds it (a family whose layers move themselves while
    being built, ``.to()`` in ``__init__``, builds there too), then what a profile runs made fake
    (`_make_fake`).

    Raises:
        ValueError: The model cannot be built (the family and the cause named).
    """
    from automodel_modules.fake_mode import fake_mode

    try:
        with torch.device("meta"):
            model = _causal_lm(model_config, dtype, attn_implementation)
        blocks = find_transformer_blocks(model)
        with fake_mode() as mode:
            _make_fake(model, skip=[blocks[index][1] for index in repeated_blocks(blocks)])
    except _FAKE_FAILURES as exc:
        raise _unprofilable(model_config, "building it", exc) from exc
    return FakeModel(mode, model, dtype, attn_implementation)


def _make_fake(model: nn.Module, skip: Sequence[nn.Module] = ()) -> None:
    """Replace the parameters and buffers of ``model`` that are not fake by fake CPU ones (in place).

    They are meta tensors of a meta build, or real ones a family makes whatever the default device
    (DiffLlama's ``torch.normal``). Preconditions: the fake mode is active. Only tensors a module outside
    ``skip`` holds are replaced (in every module holding them, so a parameter shared with a skipped block
    stays shared). Tied parameters stay tied; requires_grad is kept.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    run: list[nn.Module] = []
    stack, seen = [model], set(map(id, skip))
    while stack:  # the modules reachable without entering a skipped one
        module = stack.pop()
        if id(module) not in seen:
            seen.add(id(module))
            run.append(module)
            stack.extend(child for child in module._modules.values() if child is not None)
    wanted = {
        id(tensor)
        for module in run
        for tensor in (*module._parameters.values(), *module._buffers.values())
        if tensor is not None and not isinstance(tensor, FakeTensor)
    }
    params: dict[int, nn.Parameter] = {}
    buffers: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) in wanted:
                if id(param) not in params:
                    fresh = torch.empty(param.shape, dtype=param.dtype, device="cpu")  # as a fake build's
                    params[id(param)] = nn.Parameter(fresh, requires_grad=param.requires_grad)
                module._parameters[name] = params[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None and id(buffer) in wanted:
                if id(buffer) not in buffers:
                    buffers[id(buffer)] = torch.empty(buffer.shape, dtype=buffer.dtype, device="cpu")
                module._buffers[name] = buffers[id(buffer)]


def profile_step(
    model_config: Any,
    *,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    cp: int = 1,
    attn_implementation: str | None = None,
    every_block: bool = False,
    fake: FakeModel | None = None,
) -> StepProfile:
    """Profile one micro-batch's forward on fake tensors: what it saves for backward and what it computes.

    Preconditions: ``model_config`` builds a causal LM with ``AutoModelForCausalLM.from_config``.
    Nothing is allocated and ``model_config`` is not mutated (a copy is built). Of the blocks of one
    kind only the first two run; the others take the second's counts (`repeated_blocks`).

    Args:
        model_config: The transformers config (real widths).
        micro_batch: Rows per forward.
        seq_len: Tokens per row (the whole sequence; each CP rank sees ``seq_len // cp``).
        dtype: The compute dtype of the activations (the parameter dtype, or autocast's).
        cp: Context-parallel degree: each rank runs the forward on its sequence shard.
        attn_implementation: The attention implementation (default: the config's, else ``sdpa``).
        every_block: Run every block (what the repeated-block shortcut is tested against).
        fake: `build_fake_model` of ``model_config``, ``dtype`` and ``attn_implementation``, to reuse
            (built here when None). Its blocks are as they were when the profile returns, but for
            ``every_block``, which leaves none of its tensors on meta.

    Returns:
        Per-block and outside-the-blocks saved bytes and work on one rank, before tensor parallelism.

    Raises:
        ValueError: ``seq_len`` not divisible by ``cp``, or a size below 1.
    """
    from automodel_distributed.tensor_parallel import sharded_layer_kinds
    from automodel_modules.fake_mode import fake_mode

    if micro_batch < 1 or seq_len < 1 or cp < 1:
        raise ValueError(f"micro_batch, seq_len and cp must be >= 1, got {micro_batch}, {seq_len}, {cp}")
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} must be divisible by cp={cp} (each CP rank holds a shard)")
    local_seq = seq_len // cp
    fake = fake if fake is not None else build_fake_model(model_config, dtype, attn_implementation)
    assert (fake.dtype, fake.attn_implementation) == (dtype, attn_implementation), "another model's build"
    with fake_mode(fake.mode):
        model = fake.model
        blocks = find_transformer_blocks(model)
        if every_block:  # the blocks the build left on meta run too
            _make_fake(model)
        recorder = _Recorder(model, blocks, sharded_layer_kinds(model))
        compute = ComputeRecorder(len(blocks), partial(_where, recorder, blocks), recorder.parameters)
        handles = recorder.hooks(model, blocks)
        copies = {} if every_block else repeated_blocks(blocks)
        handles += skip_repeated(blocks, copies)
        device = next(model.parameters()).device  # wherever transformers built the fake model
        ids = torch.zeros(micro_batch, local_seq, dtype=torch.long, device=device)
        saved = torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t)
        try:
            with (
                compute,
                recorder.producers,
                saved,
                CudaSdpaChoice(),
                unpacked_rows(),
                _fake_tensor_log_quiet(),
            ):
                model(input_ids=ids, labels=ids)
        except _FAKE_FAILURES as exc:
            what = f"its forward on {micro_batch} x {local_seq} tokens"
            raise _unprofilable(model_config, what, exc, seq_len) from exc
        finally:  # a fake model kept for other shapes must come back as it was
            for handle in handles:
                handle.remove()
    tokens = micro_batch * local_seq
    return StepProfile(recorder.profile(len(blocks), tokens, copies), compute.profile(tokens, copies))


@contextlib.contextmanager
def _fake_tensor_log_quiet() -> Iterator[None]:
    """Hold back torch's log of a failed fake op (a whole traceback): `_unprofilable` says what failed."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


_FAKE_FAILURES = (RuntimeError, ValueError, TypeError, AttributeError, IndexError, NotImplementedError)
"""What a model's build or forward raises on fake tensors where it cannot run there (`_unprofilable`)."""


def _unprofilable(model_config: Any, what: str, exc: Exception, seq_len: int | None = None) -> ValueError:
    """The planner's error for a model it cannot run on fake tensors: the model, the step, the cause.

    ``seq_len``: the sequence the forward ran, named when it exceeds the model's positions.
    """
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    name = getattr(model_config, "model_type", type(model_config).__name__)
    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException)):
        cause = f"it reads tensor values to decide shapes ({exc}), which a forward on fake tensors cannot"
    else:
        cause = f"{type(exc).__name__}: {exc}"
    message = f"the planner cannot profile {name} ({what}): {cause}"
    positions = getattr(model_config, "max_position_embeddings", None)
    if seq_len is not None and isinstance(positions, int) and seq_len > positions:
        message += f" (seq_len {seq_len} exceeds its max_position_embeddings {positions}: lower seq_len)"
    return ValueError(message)


def profile_activations(
    model_config: Any,
    *,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    cp: int = 1,
    attn_implementation: str | None = None,
) -> ActivationProfile:
    """Profile the activations one micro-batch saves (`profile_step`'s ``activations``; same arguments)."""
    return profile_step(
        model_config,
        micro_batch=micro_batch,
        seq_len=seq_len,
        dtype=dtype,
        cp=cp,
        attn_implementation=attn_implementation,
    ).activations


def activation_bytes(
    profile: ActivationProfile,
    *,
    checkpointing: Checkpointing,
    blocks: Sequence[int] | None = None,
    in_flight: float = 1.0,
    tp: int = 1,
    sequence_parallel: bool = False,
    first_stage: bool = True,
    last_stage: bool = True,
    compiled_loss: bool = False,
) -> int:
    """Peak saved-activation bytes of one rank during backward.

    Args:
        profile: From `profile_activations` (one micro-batch on one rank).
        checkpointing: ``False``, ``"full"`` (each block keeps its input and is recomputed, one at a
            time, during backward) or ``"selective"`` (keeps attention and every other matmul output).
        blocks: Indices of the blocks this rank runs (default: all).
        in_flight: Micro-batches whose activations of ``blocks`` the rank holds at once (pipeline
            schedules: `automodel_pipelining.schedules.in_flight_microbatches` / stages per rank).
        tp: Tensor-parallel degree.
        sequence_parallel: Whether boundary tensors are sharded over ``tp`` too.
        first_stage: Whether the rank holds the embedding.
        last_stage: Whether the rank holds the head and the loss.
        compiled_loss: Whether the loss is compiled (`ActivationProfile.head_bytes`).

    Returns:
        Bytes.
    """
    held, recompute = _held_and_recompute(profile, checkpointing, blocks, tp, sequence_parallel)
    outside = (profile.embedding if first_stage else 0) + (
        profile.head_bytes(tp, compiled_loss) if last_stage else 0
    )
    return int(in_flight * held) + max(recompute, 0) + outside


def held_per_microbatch(
    profile: ActivationProfile,
    *,
    checkpointing: Checkpointing,
    blocks: Sequence[int],
    tp: int = 1,
    sequence_parallel: bool = False,
) -> int:
    """Bytes ``blocks`` keep for backward per micro-batch: a pipeline stage's for each one in flight.

    The arguments are `activation_bytes`'; the recomputed block's and the outside parts are not counted.
    """
    return _held_and_recompute(profile, checkpointing, blocks, tp, sequence_parallel)[0]


def _held_and_recompute(
    profile: ActivationProfile,
    checkpointing: Checkpointing,
    blocks: Sequence[int] | None,
    tp: int,
    sequence_parallel: bool,
) -> tuple[int, int]:
    chosen = [profile.blocks[i] for i in (blocks if blocks is not None else range(len(profile.blocks)))]
    if not chosen:
        held = recompute = 0
    elif checkpointing == "full":
        held = sum(b.input_bytes // (tp if sequence_parallel else 1) for b in chosen)
        recompute = max(b.total(tp, sequence_parallel) for b in chosen)
    elif checkpointing == "selective":
        held = sum(b.kept(tp, sequence_parallel) for b in chosen)
        recompute = max(b.total(tp, sequence_parallel) - b.kept(tp, sequence_parallel) for b in chosen)
    else:
        held = sum(b.total(tp, sequence_parallel) for b in chosen)
        recompute = 0
    return held, recompute
