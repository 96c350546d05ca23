"""ServePlan dashboard: `make run`, or `.venv/bin/streamlit run app.py`.

A thin entry point: it registers the pages (dashboard/pages/*.py) and runs the chosen one.
Every number on them comes from the planner's own API, the same code the CLI runs.
"""

from __future__ import annotations

from pathlib import Path
import sys

import streamlit as st

# Streamlit executes this file as a script; put the repository root on the path so that the
# `dashboard` package (not part of the installed distribution) imports however it is launched.
ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

st.set_page_config(page_title="ServePlan", page_icon=":material/dns:", layout="wide")

PAGES = [
    st.Page("dashboard/pages/plan.py", title="Plan", icon=":material/query_stats:", default=True),
    st.Page("dashboard/pages/simulate.py", title="Simulate", icon=":material/timeline:"),
    st.Page("dashboard/pages/compare.py", title="Compare", icon=":material/compare_arrows:"),
    st.Page("dashboard/pages/memory.py", title="Memory", icon=":material/memory:"),
    st.Page("dashboard/pages/hardware.py", title="Hardware", icon=":material/developer_board:"),
    st.Page("dashboard/pages/validate.py", title="Validate", icon=":material/fact_check:"),
]
st.navigation(PAGES).run()
