"""The one exception type users see."""


class LowbitError(ValueError):
    """An error the user can fix; the message says how."""
