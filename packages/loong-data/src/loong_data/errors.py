"""The one base class of loong-data's input errors, so that an app can report any of them in one line."""


class DataError(ValueError):
    """Input data that cannot be used; the message names the file (and line or sample) and what
    was expected. Every loong-data error about a user's data derives from it."""
