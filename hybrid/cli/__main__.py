"""``python -m hybrid.cli``: the same as the ``hybrid`` command."""

from . import main

main()
