"""Errors shared by every room."""


class UserError(Exception):
    """A problem the user can fix (bad config, missing runtime, bad file).

    The CLI prints it as one line, without a traceback.
    """
