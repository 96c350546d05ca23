"""Page state mirrored into the URL (`st.query_params`), so that a view can be shared as a link.

A bound widget starts from, in order: its live widget state; the value its page last had in
this session (Streamlit drops widget state when the user visits another page, and page changes
clear the query string); the URL; the default. After the widgets are drawn, `sync_url` writes
each value that differs from its default back into the URL, keeping links short.

A URL is input from anyone who sends a link, so every parameter is read through the same check
its widget's declaration makes (dashboard/inputs.py): a value the widget could not hold is never
clamped or replaced silently. `sync_url` shows each refused parameter (name, short excerpt of the
value, what is allowed) and stops the page before anything is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import streamlit as st

from dashboard import ui
from engine.errors import InputError, excerpt

T = TypeVar("T")


def parse_bool(text: str) -> bool:
    # bool("false") is True, so booleans need their own parser.
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise InputError("value", text, "must be true or false")


def parse_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}"
    return str(value)


class PageState:
    """The URL-backed values of one page; widget keys are namespaced by the page."""

    def __init__(self, page: str) -> None:
        self.page = page
        self._defaults: dict[str, Any] = {}
        self.labels: dict[str, str] = {}  # field -> label of the widget that sets it
        self._refused: list[str] = []

    def key(self, name: str) -> str:
        return f"{self.page}.{name}"

    def _saved_key(self, name: str) -> str:
        return f"_saved.{self.page}.{name}"

    def bind(self, name: str, default: Any, parse: Callable[[str], Any] | None = None, *,
             label: str | None = None, field: str | None = None) -> str:
        """Register URL parameter `name` and seed its widget state; returns the widget key.

        `parse` turns the URL text into the widget's value or raises InputError (booleans and
        text have defaults); `label` and `field` let errors about `field` (default: `name`) name
        the widget."""
        key = self.key(name)
        self._defaults[name] = default
        if label is not None:  # errors may name the field or, like the planner's, the parameter
            self.labels[name] = self.labels[field or name] = label
        if key in st.session_state:
            return key
        if self._saved_key(name) in st.session_state:
            st.session_state[key] = st.session_state[self._saved_key(name)]
            return key
        raw = st.query_params.get(name)
        value = default
        if raw is not None:
            parse = parse or (parse_bool if isinstance(default, bool) else str)
            try:
                value = parse(raw)
            except InputError as exc:
                self._refused.append(f"URL parameter {name}={excerpt(raw)} is invalid: {exc.allowed}")
        st.session_state[key] = value
        return key

    def get(self, name: str) -> Any:
        return st.session_state[self.key(name)]

    def set(self, name: str, value: Any) -> None:
        """For values no widget owns (e.g. 'a plan was run'); widget values change by user input."""
        st.session_state[self.key(name)] = value

    def attempt(self, fn: Callable[[], T]) -> T:
        """fn(), or its bad input shown in place in this page's words, and the page stopped."""
        return ui.attempt(fn, self.labels)

    def sync_url(self) -> None:
        """Write every bound value into the URL (defaults left out) and remember it for this
        session; then report URL parameters that were refused or that this page does not have,
        and stop the page if any was refused."""
        unknown = [name for name in st.query_params if name not in self._defaults]
        for name in unknown:
            st.warning(f"URL parameter {excerpt(name)} is not one of this page's; ignored "
                       f"(this page reads: {', '.join(sorted(self._defaults))})")
            del st.query_params[name]
        for name, default in self._defaults.items():
            value = st.session_state.get(self.key(name), default)
            st.session_state[self._saved_key(name)] = value
            if value == default:
                if name in st.query_params:
                    del st.query_params[name]
            else:
                text = format_value(value)
                if st.query_params.get(name) != text:
                    st.query_params[name] = text
        if self._refused:
            for line in self._refused:
                st.error(line, icon=":material/link_off:")
            st.info("The inputs in the sidebar show the defaults used instead; change any of them to go on.")
            st.stop()
