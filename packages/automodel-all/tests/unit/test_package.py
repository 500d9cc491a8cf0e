"""The package installs alone, reports its distribution's version and exports only what exists."""

from __future__ import annotations

import importlib.metadata

import automodel_all


def test_version_matches_the_installed_distribution() -> None:
    assert automodel_all.__version__ == importlib.metadata.version("automodel-all")


def test_every_exported_name_exists() -> None:
    missing = [name for name in automodel_all.__all__ if not hasattr(automodel_all, name)]
    assert not missing, missing
