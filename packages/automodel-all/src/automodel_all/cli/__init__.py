"""The ``automodel`` command: ``automodel train`` runs a job, ``automodel plan`` dry-runs its layout."""

from automodel_all.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
