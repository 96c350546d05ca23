"""The one error type for bad input, shared by the engine, the planner, the CLI and the dashboard."""

from __future__ import annotations

from collections.abc import Callable, Iterable
import difflib


class InputError(ValueError):
    """Bad input from a user: the message names the field, the value and what is allowed.

    Front ends print the message alone (no traceback) and exit non-zero.
    """

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={value!r} is invalid: {allowed}")

    @classmethod
    def from_value_error(cls, exc: ValueError, rename: Callable[[str], str] = str) -> InputError:
        """Re-raise a torch-free core check ("field=value is invalid: allowed") as an InputError,
        optionally renaming the field to the flag the user typed."""
        field, _, rest = str(exc).partition("=")
        value, _, allowed = rest.partition(" is invalid: ")
        return cls(rename(field), value, allowed)


def unknown_name_error(field: str, value: str, known: Iterable[str]) -> InputError:
    """An InputError for an unknown catalog name that suggests the closest known names."""
    known = sorted(known)
    close = difflib.get_close_matches(value.lower(), known, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"known names: {', '.join(known)}"
    return InputError(field, value, f"unknown name; {hint}")
