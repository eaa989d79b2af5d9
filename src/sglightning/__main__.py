"""``python -m sglightning fit | validate …``: the same as the ``sglightning`` command."""

from sglightning.cli import main

raise SystemExit(main())
