"""``python -m controlplane.cli``: the ``infergate`` command."""

from controlplane.cli import main

main()
