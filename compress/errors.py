"""One exception type for every user-facing problem.

A ``CompressError`` carries a paragraph that names the problem and the fix.
The CLI prints it without a traceback and exits with status 2.
"""

import argparse


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
