"""The one exception type the CLI turns into a one-line message (exit 1)."""


class OscarError(Exception):
    """A problem the user can fix; the message says what is wrong and how to fix it."""
