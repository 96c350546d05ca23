"""Shared page furniture: in-page errors instead of tracebacks, tables with downloads, assumptions."""

from __future__ import annotations

from collections.abc import Callable, Mapping
import json
import math
import numbers
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


def readable(value: Any) -> str:
    """A number as a person reads it: thousands separated, whole numbers without decimals, others
    to about three significant digits (28,105 not 28,105.000; 15.2 not 15.2073); empty for none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    size = abs(float(value))
    if float(value).is_integer() or size >= 100:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:,.1f}"
    return f"{value:.2f}" if size >= 1 else f"{value:.3g}"


# Formatting each cell on the server costs per cell; bigger tables (per-request and per-step data)
# are shown as they are, like their downloads.
MAX_FORMATTED_CELLS = 20_000


def table(df: pd.DataFrame, title: str, *, key: str, hide_index: bool = True, caption: str | None = None) -> None:
    """A dataframe with numbers formatted for people (`readable`; sorting uses the values) and CSV
    and JSON downloads of exactly the values shown, unrounded."""
    st.markdown(f"**{title}**")
    if caption:
        st.caption(caption)
    numeric = [c for c in df.columns if pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])]
    shown = df.style.format(readable, subset=numeric) if numeric and df.size <= MAX_FORMATTED_CELLS else df
    st.dataframe(shown, hide_index=hide_index, width="stretch")
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
