"""``python -m nostall``: the same as the ``nostall`` command."""

from ._tools.cli import main

raise SystemExit(main())
