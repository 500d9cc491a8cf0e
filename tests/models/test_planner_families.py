"""``automodel plan`` on every decoder family transformers ships: it plans, or refuses with the reason.

Each family's tiny config (`automodel_testing.tiny`) is saved and planned in-process on 2 x H100 (memory
and the time model): exit 0 with a predicted step, or exit 2 with the one reason listed for that family
in `REFUSED` and no traceback. A family newly refused, or one that now plans, fails here until the
list says so. The same under each attention kernel only a GPU runs (flash-attn's, FlexAttention's):
planned on this CPU host as the GPU runs it, or refused where the family's own transformers flag says
it does not support the kernel. The ``models`` nox session runs every family (143 plans per kernel,
about a minute each); the default run one of each kind (`FAST_SLICE`, and five families under both
kernels).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from automodel_all.cli.main import main
from automodel_testing.families import decoder_families

REFUSED: dict[str, str] = {
    # Their forward reads tensor values to choose shapes (patching, routing): no fake forward runs it.
    "blt": "reads tensor values to decide shapes",
    "jetmoe": "reads tensor values to decide shapes",
    "longcat_flash": "reads tensor values to decide shapes",
    "qwen4_exp_text": "reads tensor values to decide shapes",
    # Tiny configs with fewer learned positions than the job's rows.
    "gpt_neo": "exceeds its max_position_embeddings",
    "openai-gpt": "exceeds its max_position_embeddings",
    # Its kernel mixes fp32 and bf16 operands in the planned dtype.
    "xlstm": "expected scalar type",
    # transformers itself cannot build its tiny config (DbrxAttentionConfig lacks rope_theta).
    "dbrx": "transformers cannot build",
}


FAST_SLICE = (
    "mamba",  # no SDPA in transformers: built with the family's default (eager) attention
    "deepseek_v4",  # layers that move themselves in __init__ (.to()), which no fake build can
    "diffllama",  # torch.normal in __init__ ignores the meta device: real tensors, then made fake
    "gemma4_text",  # head_dim differs per layer: counted at the largest layer's
    "jetmoe",  # its forward reads routing values to choose shapes: refused
    "gpt_neo",  # learned positions shorter than the job's rows: refused, naming them
)


@pytest.mark.parametrize("model_type", FAST_SLICE)
def test_one_family_of_each_kind_plans_or_is_refused_with_its_reason(
    model_type: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _plans_or_is_refused(model_type, tmp_path, capsys)


@pytest.mark.models
@pytest.mark.parametrize("model_type", [f.model_type for f in decoder_families()])
def test_every_decoder_family_plans_or_is_refused_with_its_reason(
    model_type: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _plans_or_is_refused(model_type, tmp_path, capsys)


@pytest.mark.parametrize("kernel", ["flash_attention_2", "flex_attention"])
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt_oss", "falcon", "mpt"])
def test_a_gpu_only_attention_kernel_plans_or_is_refused_by_the_models_own_flag(
    model_type: str, kernel: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _plans_or_is_refused(model_type, tmp_path, capsys, kernel)


@pytest.mark.models
@pytest.mark.parametrize("kernel", ["flash_attention_2", "flex_attention"])
@pytest.mark.parametrize("model_type", [f.model_type for f in decoder_families()])
def test_every_decoder_family_plans_a_gpu_only_attention_kernel_or_is_refused(
    model_type: str, kernel: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _plans_or_is_refused(model_type, tmp_path, capsys, kernel)


def _plans_or_is_refused(
    model_type: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], kernel: str | None = None
) -> None:
    """``kernel``: the job's ``model.attn_implementation``, one only a GPU runs (None: the default).

    Such a job is planned on this CPU host as the GPU runs it (`automodel_planner.sdpa_choice`), or
    refused where transformers' own flag says the family does not support the kernel.
    """
    from automodel_all.cli.model import model_class
    from automodel_testing.tiny import derive_tiny_config

    config = derive_tiny_config(model_type)
    config.save_pretrained(tmp_path)
    argv = ["plan", "--model", str(tmp_path), "--world-size", "2", "--cluster", "2xH100"]
    argv += ["--set", f"model.attn_implementation={kernel}"] if kernel else []
    code = main(argv)
    out, err = capsys.readouterr()
    flag = "_supports_flex_attn" if kernel == "flex_attention" else "_supports_flash_attn"
    if kernel and not getattr(model_class(config), flag, False):
        assert code == 2 and f"does not support {kernel!r}" in err, err[-2000:]
        assert "Traceback" not in err
    elif model_type in REFUSED:
        assert code == 2 and REFUSED[model_type] in err, err[-2000:]
        assert "Traceback" not in err
    else:
        assert code == 0, err[-2000:]
        assert "tokens/s per GPU" in out
