"""Opening a dashboard page headless (streamlit.testing.v1.AppTest) as a link would: the page
and its URL query parameters. Shared by the dashboard tests and the URL fuzz suite."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[2] / "app.py")


def open_page(page: str, **params: str) -> AppTest:
    """The app on `page` (dashboard/pages/<page>.py) with URL query parameters `params`, run once."""
    at = AppTest.from_file(APP, default_timeout=120)
    if page != "plan":
        at.run()  # the default page (Plan) draws its form only; switching needs one run first
        at.switch_page(f"dashboard/pages/{page}.py")
    for key, value in params.items():
        at.query_params[key] = value
    return at.run()
