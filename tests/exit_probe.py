"""``sglightning`` (its console entry point) under two probes: ``$SGL_EXIT_PROBE/hooks<rank>`` is written when the
exit hooks run, and a C exit handler aborts the process (exit -6, as gloo's threads did) if it reaches the C
library's exit, that is, if it ends through interpreter teardown rather than ``os._exit``.

A script, not ``-c``: Lightning launches the other ranks by running the same script again, so every rank is probed.
"""

import atexit
import ctypes
import os
import sys
from pathlib import Path

_libc = ctypes.CDLL(None)
# a C exit handler (glibc exports atexit's own entry, __cxa_atexit): run by exit() after teardown, never by _exit()
_libc.__cxa_atexit(ctypes.cast(_libc.abort, ctypes.c_void_p), None, None)
_rank = os.environ.get("LOCAL_RANK", "0")
atexit.register(lambda: (Path(os.environ["SGL_EXIT_PROBE"]) / f"hooks{_rank}").write_text("hooks"))

from sglightning.entry import main  # noqa: E402  (the probes first)

sys.exit(main())
