"""Errors shared by every room."""


class UserError(Exception):
    """A problem the user can fix (bad config, missing runtime, bad file); printed as one line, no traceback."""
