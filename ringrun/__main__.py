"""``python -m ringrun``: the same as the ``ringrun`` command."""

from ._cli import main

raise SystemExit(main())
