"""``python -m sglightning fit | validate …``: the same as the ``sglightning`` command."""

from sglightning.entry import main

raise SystemExit(main())
