"""automodel-testing: the test harness of the automodel workspace (not published).

- `run_distributed`: run a function on N real ``torch.distributed`` ranks and collect the results.
- Tiny Hugging Face model factories (``[hf]`` extra; transformers is imported lazily).
- Numeric asserts that compare results with a single-process reference.
- `load_script`: import a repository script (``tools/``, ``benchmarks/``) by path.
"""

from automodel_testing.checkpoints import safetensors_differences, stored_tensors
from automodel_testing.distributed import (
    DistributedRunError,
    available_gpus,
    run_distributed,
    skip_unless_gpus,
)
from automodel_testing.models import (
    TINY_FAMILIES,
    build_tiny_model,
    make_batch,
    save_tiny_checkpoint,
    tiny_config,
)
from automodel_testing.numerics import (
    assert_grads_close,
    assert_tensors_close,
    grads_by_name,
    normalize_fqn,
    params_by_name,
    reference_loss_and_grads,
    to_full,
)
from automodel_testing.parity import ParityReport, causal_lm_loss, train_parity
from automodel_testing.scripts import load_script

__all__ = [
    "TINY_FAMILIES",
    "DistributedRunError",
    "ParityReport",
    "assert_grads_close",
    "assert_tensors_close",
    "available_gpus",
    "build_tiny_model",
    "causal_lm_loss",
    "grads_by_name",
    "load_script",
    "make_batch",
    "normalize_fqn",
    "params_by_name",
    "reference_loss_and_grads",
    "run_distributed",
    "safetensors_differences",
    "save_tiny_checkpoint",
    "skip_unless_gpus",
    "stored_tensors",
    "tiny_config",
    "to_full",
    "train_parity",
]
