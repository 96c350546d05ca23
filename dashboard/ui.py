"""Shared page furniture: in-page errors instead of tracebacks, tables with downloads, assumptions."""

from __future__ import annotations

from collections.abc import Callable, Mapping
import json
import re
from typing import Any, NoReturn, TypeVar

import pandas as pd
from pydantic import ValidationError
import streamlit as st

from engine.errors import InputError, excerpt, from_validation_error

T = TypeVar("T")


def error_message(exc: InputError, labels: Mapping[str, str]) -> str:
    """An InputError in the dashboard's words: its field named by the label of the widget that
    sets it (`Tensor parallel (GPUs per replica): 3 is invalid: ...`), else by the field."""
    label = labels.get(exc.field) or ("" if ":" in exc.field else labels.get(exc.field.rsplit(".", 1)[-1]))
    return f"{label}: {excerpt(exc.value)} is invalid: {exc.allowed}" if label else exc.message()


def stop_with(message: str) -> NoReturn:
    st.error(message, icon=":material/error:")
    st.stop()
    raise AssertionError("st.stop() returned")  # st.stop raises; this keeps type checkers honest


def attempt(fn: Callable[[], T], labels: Mapping[str, str] | None = None) -> T:
    """fn(), or its InputError / ValidationError shown in place, and the page stopped there.

    Both name the field, the value and what is allowed, which is what the user needs; `labels`
    (field -> widget label, from PageState) names the field as the sidebar does. Anything else is
    a bug and keeps Streamlit's own error display.
    """
    try:
        return fn()
    except ValidationError as exc:
        stop_with(error_message(from_validation_error(exc), labels or {}))
    except InputError as exc:
        stop_with(error_message(exc, labels or {}))


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def table(df: pd.DataFrame, title: str, *, key: str, hide_index: bool = True, caption: str | None = None) -> None:
    """A dataframe with CSV and JSON downloads of exactly what is shown."""
    st.markdown(f"**{title}**")
    if caption:
        st.caption(caption)
    st.dataframe(df, hide_index=hide_index, width="stretch")
    name = _slug(title)
    left, right, _ = st.columns([1, 1, 4])
    left.download_button("CSV", df.to_csv(index=not hide_index).encode(), f"{name}.csv", "text/csv",
                         key=f"{key}.csv", icon=":material/download:")
    right.download_button("JSON", df.to_json(orient="records", indent=2).encode(), f"{name}.json",
                          "application/json", key=f"{key}.json", icon=":material/download:")


def json_download(label: str, data: Any, file_name: str, *, key: str) -> None:
    """Download of a whole result object (a pydantic model's JSON, the same as the CLI's --json)."""
    text = data.model_dump_json(indent=2) if hasattr(data, "model_dump_json") else json.dumps(data, indent=2, default=str)
    st.download_button(label, text.encode(), file_name, "application/json", key=key, icon=":material/download:")


def assumptions(title: str, lines: list[str] | None = None, data: dict[str, Any] | None = None) -> None:
    """An expander with what a figure assumed: sentences first, then the raw figures."""
    with st.expander(f"Assumptions: {title}"):
        for line in lines or []:
            st.markdown(f"- {line}")
        if data:
            st.json(data, expanded=False)
