"""The one error type for bad input, shared by the engine, the planner, the CLI and the dashboard.

`InputError` itself lives in the torch-free core (engine/core/errors.py) so that the core raises
it too; this module adds what needs more than the standard library: turning a pydantic
ValidationError into an InputError, and suggesting names for an unknown catalog entry.
"""

from __future__ import annotations

from collections.abc import Iterable
import difflib

from pydantic import ValidationError

from engine import limits
from engine.core.errors import EXCERPT_CHARS, InputError, excerpt

__all__ = ["EXCERPT_CHARS", "InputError", "excerpt", "from_validation_error", "over_limit", "unknown_name_error"]


def from_validation_error(exc: ValidationError, where: str = "") -> InputError:
    """The first problem pydantic found, as an InputError whose field is the path to the value
    (`knobs.max_num_seqs`), prefixed by `where` (a file name, a section) when given.

    A validator that raised an InputError itself keeps its field, value and wording.
    """
    err = exc.errors()[0]
    # A part of the path can be a key the user wrote (an unknown field): any text, any length.
    path = [part if isinstance(part, str) and part.isprintable() and len(part) <= 64 else
            str(part) if isinstance(part, int) else excerpt(part) for part in err["loc"]]
    raised = err.get("ctx", {}).get("error")
    if isinstance(raised, InputError):
        field, value, allowed = ".".join([*path, raised.field]), raised.value, raised.allowed
    elif err["type"] == "missing":  # its input is the whole enclosing object: name none of it
        field, value, allowed = ".".join(path), None, "required"
    elif err["type"] == "json_invalid":  # its input is the whole document: say only how long it is
        field, value, allowed = ".".join(path), f"{len(err.get('input') or '')} bytes", err["msg"]
    else:
        field, value, allowed = ".".join(path), err.get("input"), err["msg"].removeprefix("Value error, ")
    field = field or exc.title
    return InputError(f"{where}: {field}" if where else field, value, allowed)


def over_limit(field: str, value: object, limit: str, what: str) -> InputError:
    """`field`'s `value` makes `what` exceed engine.limits.`limit` (read now, so a raised limit counts)."""
    return InputError(field, value, f"{what} exceeds the limit {limit}={getattr(limits, limit):,}; see docs/security.md")


def unknown_name_error(field: str, value: str, known: Iterable[str]) -> InputError:
    """An InputError for an unknown catalog name that suggests the closest known names."""
    known = sorted(known)
    close = difflib.get_close_matches(value.lower(), known, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"known names: {', '.join(known)}"
    return InputError(field, value, f"unknown name; {hint}")
