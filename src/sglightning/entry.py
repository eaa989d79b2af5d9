"""The ``sglightning`` command and ``python -m sglightning``: what must be checked before torch loads, then the CLI.

Why apart from :mod:`sglightning.cli`: the OpenMP runtime that torch loads reads ``OMP_NUM_THREADS`` as it loads, and
prints its own complaint about a bad value.  Checked here, before any import of torch, a bad value ends in one line of
ours (exit 2), as every other bad input does.
"""

from __future__ import annotations

import sys

from sglightning.errors import ConfigError, exit_process
from sglightning.threads import check_environment


def main() -> int:
    """Console-script entry point: exit code 2 with one line for a bad ``OMP_NUM_THREADS``, else
    :func:`sglightning.cli.main`'s."""
    try:
        if not {"-h", "--help"} & set(sys.argv[1:]):  # help needs no threads (and its line points to it)
            check_environment()
    except ConfigError as err:
        sub = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in ("fit", "validate") else ""
        prog = f"sglightning {sub}".strip()
        print(f"{prog}: error: {err} (see: {prog} --help)", file=sys.stderr)
        return 2
    try:
        from sglightning.cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:  # Ctrl-C before the trainer runs (importing torch, parsing, loading the model)
        print("sglightning: interrupted before the run started; nothing was written", file=sys.stderr)
        exit_process(130)  # not `return`: CPython may end the process by SIGINT instead (see exit_process)
