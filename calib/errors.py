"""Errors a user can cause.

Every command catches :class:`UserError` (and the runtime's ``ArtifactError``) at the top, prints the
one-line message to stderr and exits with status 2: no traceback for mistakes a user can fix.
"""


class UserError(Exception):
    """A problem the user can fix; the message names the problem and the fix, in one line."""
