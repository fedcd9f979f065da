"""``python -m cli``: the ``trace`` command."""

from cli.app import main

main()
