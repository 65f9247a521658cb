"""One exception type for every user-facing problem.

A ``CompressError`` carries a paragraph that names the problem and the fix.
The CLI prints it without a traceback and exits with status 2.
"""


class CompressError(Exception):
    """A problem the user can fix: bad config, missing file, unsupported model."""
