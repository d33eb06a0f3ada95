"""accelerate's ``clear_environment``, made safe for a process whose threads each build a Trainer.

``Accelerator()`` runs ``GradientState``, which calls the accumulation plugin's ``to_kwargs``, which
builds a default plugin inside ``clear_environment``: every variable is unset, then set again. Two
things break when other threads run meanwhile (XLA FSDP's CPU device threads, one Trainer each, and
their device-loader threads):

* the C environment: unsetting and setting every variable moves the array that libc's ``getenv``
  reads without a lock, and torch's and torch_xla's C++ read it while they trace and run. The XLA
  FSDP Trainer's process died in ``getenv`` (exit status -11, no message); a C thread reading one
  variable while Python ran ``clear_environment`` in a loop crashed within seconds;
* ``os.environ``: every other thread sees it empty meanwhile. torch_xla's ``jax_env_context`` in a
  device-loader thread read no ``SKIP_MEGASCALE_PJRT_CLIENT`` and removed it on its way out, and the
  threads' ``os.environ.get`` calls read nothing.

Here the clear is seen by the clearing thread alone, and the C environment is left as it is.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()  # installing and removing the replacement
_CLEARING = threading.Lock()  # one clear at a time: each replaces os.environ's mapping until it ends
_users = 0
_here = threading.local()


class _EmptyForOneThread:
    """What ``os.environ`` reads and writes (its ``_data``) during a clear: an empty mapping of its own
    for the clearing thread, the real one for every other thread."""

    def __init__(self, real: dict) -> None:
        self.real, self.own, self.thread = real, {}, threading.get_ident()

    def _seen(self) -> dict:
        return self.own if threading.get_ident() == self.thread else self.real

    def __getitem__(self, key):
        return self._seen()[key]

    def __setitem__(self, key, value) -> None:
        self._seen()[key] = value

    def __delitem__(self, key) -> None:
        del self._seen()[key]

    def __contains__(self, key) -> bool:
        return key in self._seen()

    def __iter__(self):
        return iter(list(self._seen()))

    def __len__(self) -> int:
        return len(self._seen())


@contextlib.contextmanager
def _cleared_for_this_thread() -> Iterator[None]:
    with _CLEARING:
        real = os.environ._data
        view = _EmptyForOneThread(real)
        os.environ._data = view
        try:
            yield
        finally:
            os.environ._data = real
            # what this thread wrote inside went to the C environment too; upstream's exit undoes it
            for key, value in view.own.items():
                if real.get(key) != value:
                    os.putenv(key, real[key]) if key in real else os.unsetenv(key)


@contextlib.contextmanager
def thread_scoped_clear_environment() -> Iterator[None]:
    """While this thread is in here, accelerate's ``clear_environment`` clears the environment for
    this thread's Python code only; other threads' calls get the original. The replacement is
    installed while some thread is in here and put back when the last one leaves."""
    global _users
    from accelerate.utils import environment

    with _LOCK:
        if _users == 0:
            original = environment.clear_environment

            def clear_environment():
                return _cleared_for_this_thread() if getattr(_here, "on", False) else original()

            clear_environment.original = original
            environment.clear_environment = clear_environment
        _users += 1
    _here.on = True
    try:
        yield
    finally:
        _here.on = False
        with _LOCK:
            _users -= 1
            if _users == 0:
                environment.clear_environment = environment.clear_environment.original
