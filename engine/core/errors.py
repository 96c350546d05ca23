"""InputError: bad input as three parts, the field, the value given and what is allowed.

It lives in the torch-free core so that the core's own checks (scheduler limits, sampling
parameters) raise it where they detect a problem; nothing parses messages afterwards. The field
is always the setting's own name (`max_num_seqs`, `requests_per_probe`): each front end names it
in its own terms, the CLI as the flag the user typed, the dashboard as the widget's label.
"""

from __future__ import annotations

import reprlib

# An error message shows at most this much of any value: a value can be a whole file someone
# uploaded or named, and a message must never echo its contents.
EXCERPT_CHARS = 80

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = EXCERPT_CHARS
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 8
_repr.maxlevel = 3


def excerpt(value: object) -> str:
    """repr(value), bounded: reprlib never builds the whole repr of a large value, and the
    result is cut to EXCERPT_CHARS characters."""
    try:
        text = _repr.repr(value)
    except ValueError:  # an int longer than repr() allows (sys.get_int_max_str_digits)
        text = f"<{type(value).__name__} too long to show>"
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."


class InputError(ValueError):
    """Bad input from a user: `field` (the setting's own name), `value` (what was given) and
    `allowed` (what would be accepted). Front ends print one line, no traceback, and exit 2."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        # One line whatever the parts hold (a YAML error's excerpt spans lines).
        self.field, self.value, self.allowed = " ".join(str(field).split()), value, " ".join(str(allowed).split())
        super().__init__(self.message())

    def message(self, name: str | None = None) -> str:
        """'name=value is invalid: allowed', the field called `name` (a flag, a label) if given."""
        return f"{name or self.field}={excerpt(self.value)} is invalid: {self.allowed}"

    def __reduce__(self) -> tuple[type[InputError], tuple[str, object, str]]:
        # Rebuilt from its parts when it crosses a process pool (the planner's workers).
        return type(self), (self.field, self.value, self.allowed)
