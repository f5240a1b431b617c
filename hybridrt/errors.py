"""The one exception type the CLI turns into a single `error: ...` line and exit code 2."""


class UserError(Exception):
    """Bad input the user can fix (path, option, prompt length, a plan that cannot fit)."""
