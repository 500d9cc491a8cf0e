"""``python -m automodel_all.cli``: the same as the ``automodel`` command."""

from automodel_all.cli.main import entry_point

entry_point()
