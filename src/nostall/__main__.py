"""``python -m nostall``: the same as the ``nostall`` command."""

from ._cli import main

raise SystemExit(main())
