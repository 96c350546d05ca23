"""Page state mirrored into the URL (`st.query_params`), so that a view can be shared as a link.

A bound widget starts from, in order: its live widget state; the value its page last had in
this session (Streamlit drops widget state when the user visits another page, and page changes
clear the query string); the URL; the default. After the widgets are drawn, `sync_url` writes
each value that differs from its default back into the URL, keeping links short.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import streamlit as st


def parse_bool(text: str) -> bool:
    # bool("false") is True, so booleans need their own parser.
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


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

    def key(self, name: str) -> str:
        return f"{self.page}.{name}"

    def _saved_key(self, name: str) -> str:
        return f"_saved.{self.page}.{name}"

    def bind(self, name: str, default: Any, parse: Callable[[str], Any] | None = None) -> str:
        """Register `name` and seed its widget state; returns the widget key to pass to st.*."""
        key = self.key(name)
        self._defaults[name] = default
        if key in st.session_state:
            return key
        if self._saved_key(name) in st.session_state:
            st.session_state[key] = st.session_state[self._saved_key(name)]
            return key
        raw = st.query_params.get(name)
        value = default
        if raw is not None:
            if parse is None:
                parse = parse_list if isinstance(default, list) else parse_bool if isinstance(default, bool) else type(default)
            try:
                value = parse(raw)
            except ValueError as exc:
                st.warning(f"URL parameter {name}={raw!r} ignored ({exc}); using {format_value(default)!r}")
        st.session_state[key] = value
        return key

    def get(self, name: str) -> Any:
        return st.session_state[self.key(name)]

    def set(self, name: str, value: Any) -> None:
        """For values no widget owns (e.g. 'a plan was run'); widget values change by user input."""
        st.session_state[self.key(name)] = value

    def sync_url(self) -> None:
        """Write every bound value into the URL (defaults left out) and remember it for this session."""
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
