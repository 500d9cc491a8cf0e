"""A setting that would act on nothing warns, naming itself; the defaults and active settings do not."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from automodel_distributed.config import CompileConfig, DDPConfig, FSDP2Config


def _warnings(build: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: FSDP2Config(fsdp2_backward_prefetch_depth=3),
            "FSDP2Config.fsdp2_backward_prefetch_depth ignored: enable_fsdp2_prefetch is False",
        ),
        (
            lambda: FSDP2Config(activation_checkpointing_scope="language"),
            "FSDP2Config.activation_checkpointing_scope ignored: activation_checkpointing is off",
        ),
        (
            lambda: DDPConfig(activation_checkpointing_scope="vision"),
            "DDPConfig.activation_checkpointing_scope ignored: activation_checkpointing is off",
        ),
        (
            lambda: CompileConfig(mode="max-autotune", fullgraph=True),
            "CompileConfig.mode, CompileConfig.fullgraph ignored: enabled is False",
        ),
    ],
)
def test_an_inert_setting_warns_naming_itself(build: Any, message: str) -> None:
    assert _warnings(build) == [message]


@pytest.mark.parametrize(
    "build",
    [
        FSDP2Config,
        DDPConfig,
        CompileConfig,
        lambda: FSDP2Config(enable_fsdp2_prefetch=True, fsdp2_backward_prefetch_depth=3),
        lambda: FSDP2Config(activation_checkpointing=True, activation_checkpointing_scope="language"),
        lambda: FSDP2Config(activation_checkpointing_scope=None),  # None is the default, normalised
        lambda: CompileConfig(enabled=True, mode="max-autotune"),
    ],
)
def test_defaults_and_active_settings_do_not_warn(build: Any) -> None:
    assert _warnings(build) == []
