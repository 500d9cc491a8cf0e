"""The package installs alone, reports its distribution's version and exports only what exists."""

from __future__ import annotations

import importlib.metadata

import automodel_infra


def test_version_matches_the_installed_distribution() -> None:
    assert automodel_infra.__version__ == importlib.metadata.version("automodel-infra")


def test_every_exported_name_exists() -> None:
    missing = [name for name in automodel_infra.__all__ if not hasattr(automodel_infra, name)]
    assert not missing, missing
