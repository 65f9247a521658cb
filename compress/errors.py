"""One exception type for every user-facing problem.

A ``CompressError`` carries a paragraph that names the problem and the fix.
The CLI prints it without a traceback and exits with status 2.
"""

import argparse
import signal
import sys


class CompressError(Exception):
    """A problem the user can fix: bad config, missing file, unsupported model."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a usage error printed as one paragraph (what is wrong, and where the
    options are listed) instead of the whole usage block; exit status 2 as argparse's."""

    def error(self, message: str):
        self.exit(
            2,
            f"error: {message}. `{self.prog} --help` lists the options.\n",
        )


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run, after the pipeline cleaned up; ``removed`` is the temporary folder it
    deleted, or None when nothing had been written."""

    def __init__(self, removed=None):
        super().__init__(removed)
        self.removed = removed

    def __str__(self) -> str:
        if self.removed:
            return f"interrupted; removed the temporary folder {self.removed}"
        return "interrupted; nothing was written"


_SIGNALLED: list[int] = []


def on_signal(signum, _frame) -> None:
    """The CLI's SIGINT / SIGTERM handler: remember the signal, then raise as Python's defaults
    do (KeyboardInterrupt; SystemExit(143) for SIGTERM). A signal that lands inside a native call
    (safetensors, a C++ kernel) can come out as another exception; :func:`signalled` still says
    what happened, so the run unwinds as an interrupt, not as that error."""
    _SIGNALLED.append(signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    sys.exit(128 + signum)


def signalled() -> int | None:
    """The first signal :func:`on_signal` received, or None."""
    return _SIGNALLED[0] if _SIGNALLED else None


def as_interrupt(e: BaseException, removed=None) -> BaseException:
    """What a run raises after cleaning up when ``e`` ended it: :class:`Interrupted` for
    Ctrl-C (or an error a SIGINT turned into), SystemExit(143) for an error a SIGTERM turned
    into; ``e`` itself otherwise."""
    sig = signalled()
    if isinstance(e, Interrupted):
        return e
    if isinstance(e, KeyboardInterrupt) or sig == signal.SIGINT:
        return Interrupted(removed)
    if sig is not None and not isinstance(e, SystemExit):
        return SystemExit(128 + sig)
    return e
