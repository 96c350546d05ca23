"""Settings declared once, front ends generated from the declaration.

A setting is a pydantic field: its type, bounds, choices, default and description are the
field's own. A `Knob` beside it in `Annotated[...]` says how a person meets it: the CLI flag,
the dashboard widget's label and the unit. `Setting` joins the two; `add_flags` turns settings
into argparse flags and dashboard/inputs.py turns them into widgets, and both read a typed value
through the field itself, so a bound is written in exactly one place (as Vidur's settings
dataclasses generate its CLI).

    block_size_tokens: Annotated[int, Knob("--block-size", "KV block size", "tokens")] = Field(
        16, ge=1, le=1024, description="Tokens per KV-cache block")
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from engine.errors import InputError


@dataclass(frozen=True)
class Knob:
    """How a setting meets people: `flag` on the command line (a boolean also gets `--no-...`),
    `label` on the dashboard (the unit is appended), and the unit."""

    flag: str
    label: str
    unit: str = ""


@dataclass(frozen=True)
class Setting:
    """One declared field as the front ends see it: name, Knob, type, bounds, choices, help."""

    name: str
    knob: Knob
    info: FieldInfo = field(repr=False, compare=False)
    _adapter: TypeAdapter[Any] = field(repr=False, compare=False)

    @classmethod
    def of(cls, model: type[BaseModel], name: str) -> Setting:
        info = model.model_fields[name]
        knob = next((m for m in info.metadata if isinstance(m, Knob)), None)
        if knob is None:
            raise TypeError(f"{model.__name__}.{name} declares no Knob")
        # Non-finite numbers are never a setting: an infinite budget or a NaN share is a typo.
        # The field's type with its bounds, built at run time: a value to mypy, not a type expression.
        field_type: Any = Annotated[info.annotation, info]
        adapter = TypeAdapter[Any](field_type, config=ConfigDict(allow_inf_nan=False))
        return cls(name, knob, info, adapter)

    # ------------------------------------------------------------------ what the field declares

    @property
    def default(self) -> Any:
        return self.info.get_default(call_default_factory=True)

    @property
    def help(self) -> str:
        return self.info.description or ""

    @property
    def optional(self) -> bool:
        """None is a value: the setting may be left unset (for an engine knob: the engine's default)."""
        return type(None) in get_args(self.info.annotation)

    @property
    def choices(self) -> tuple[Any, ...] | None:
        literal = next((a for a in (self.info.annotation, *get_args(self.info.annotation)) if get_origin(a) is Literal), None)
        return get_args(literal) if literal is not None else None

    @property
    def kind(self) -> type:
        """bool, int, float or str (a Literal's values are str)."""
        if self.choices is not None:
            return type(self.choices[0])
        base = self.info.annotation
        if get_origin(base) in (Union, types.UnionType):
            base = next(a for a in get_args(base) if a is not type(None))
        if not isinstance(base, type):
            raise TypeError(f"{self.name}: a Knob's field is a bool, int, float, str or a Literal of them, not {base!r}")
        return base

    def bound(self, side: Literal["min", "max"]) -> tuple[float | None, bool]:
        """(limit, inclusive) on one side; (None, True) when unbounded."""
        inclusive, exclusive = (at.Ge, at.Gt) if side == "min" else (at.Le, at.Lt)
        for m in self.info.metadata:
            if isinstance(m, inclusive | exclusive):
                return getattr(m, type(m).__name__.lower()), isinstance(m, inclusive)
        return None, True

    def allowed(self) -> str:
        """What the field accepts, in words: 'an integer in 1..1024 (tokens)'."""
        if self.choices is not None:
            text = "one of " + ", ".join(map(str, self.choices))
        elif self.kind is bool:
            text = "true or false"
        elif self.kind in (int, float):
            (lo, lo_in), (hi, hi_in) = self.bound("min"), self.bound("max")
            noun = "an integer" if self.kind is int else "a finite number"
            lo_text, hi_text = _shown(lo), _shown(hi)
            if lo is not None and hi is not None:
                text = f"{noun} in {lo_text}..{hi_text}" if lo_in and hi_in else \
                    f"{noun} in {'[' if lo_in else '('}{lo_text}, {hi_text}{']' if hi_in else ')'}"
            elif lo is not None:
                text = f"{noun} {'>=' if lo_in else '>'} {lo_text}"
            elif hi is not None:
                text = f"{noun} {'<=' if hi_in else '<'} {hi_text}"
            else:
                text = noun
        else:  # free text with a pattern: its description says what it accepts
            text = self.help
        return f"{text} ({self.knob.unit})" if self.knob.unit else text

    @property
    def url_name(self) -> str:
        """The dashboard's URL parameter: the flag without dashes, `--block-size` -> `block_size`."""
        return self.knob.flag.removeprefix("--").replace("-", "_")

    @property
    def label(self) -> str:
        return f"{self.knob.label} ({self.knob.unit})" if self.knob.unit else self.knob.label

    # ------------------------------------------------------------------ reading a value

    def check(self, value: object) -> Any:
        """The value as the field types it ('16' -> 16, 'false' -> False), or an InputError
        naming the field, the value and what is allowed."""
        try:
            return self._adapter.validate_python(value)
        except ValidationError:
            raise InputError(self.name, value, f"must be {self.allowed()}") from None


def settings(model: type[BaseModel], *names: str) -> list[Setting]:
    """The settings of `model` (those named, else every field that declares a Knob), in order."""
    fields = names or [n for n, info in model.model_fields.items() if any(isinstance(m, Knob) for m in info.metadata)]
    return [Setting.of(model, n) for n in fields]


# --------------------------------------------------------------------------- the CLI


def add_flags(parser: argparse.ArgumentParser, declared: Iterable[Setting], **defaults: object) -> None:
    """One flag per setting, `dest` the field's name. Values stay as typed until `read_flags`
    checks them all through their fields, so every bad value is one InputError naming its field.
    `defaults` replaces a field's default for this command (a CPU engine runs 16 sequences);
    a default of None means "not given" (the workload's own value, say)."""
    declared = list(declared)
    for s in declared:
        default = defaults.get(s.name, s.default)
        text = f"{s.help} [{s.allowed()}]" + ("" if default is None else f" (default: {_shown(default)})")
        common: dict[str, Any] = {"dest": s.name, "default": default, "help": text.replace("%", "%%")}
        if s.kind is bool:
            parser.add_argument(s.knob.flag, action=argparse.BooleanOptionalAction, **common)
        else:
            metavar = "{" + ",".join(map(str, s.choices)) + "}" if s.choices else {int: "N", float: "X"}.get(s.kind, "TEXT")
            parser.add_argument(s.knob.flag, metavar=metavar, **common)
    parser.set_defaults(declared_settings=(*(parser.get_default("declared_settings") or ()), *declared))


def read_flags(args: argparse.Namespace) -> None:
    """Check every declared flag of the chosen command through its field, in place; a flag not
    given (None) stays None."""
    for s in getattr(args, "declared_settings", ()):
        if getattr(args, s.name) is not None:
            setattr(args, s.name, s.check(getattr(args, s.name)))


def values(args: argparse.Namespace, declared: Iterable[Setting]) -> dict[str, Any]:
    """field -> value of the given settings' flags, for building the spec they belong to."""
    return {s.name: getattr(args, s.name) for s in declared}


def command(parser: argparse.ArgumentParser, func: Callable[[argparse.Namespace], None]) -> None:
    """Register `func` as what `parser`'s command runs, with the field -> flag map the error
    handler names fields by; called once all of the command's flags are added."""
    parser.set_defaults(func=func, flags=flag_of(parser))


def flag_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """field -> the flag that sets it, for every option of `parser`: by its dest (a field's name,
    `max_gpus_per_replica`) and by the flag's own name (`max_gpus`), which some callers use."""
    flags: dict[str, str] = {}
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
            flags[flag.lstrip("-").replace("-", "_")] = flags[action.dest] = flag
    return flags


def _shown(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
