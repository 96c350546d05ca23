"""ServePlan's Streamlit dashboard: pages over the planner's own APIs (no planning logic of its own).

`app.py` at the repository root is the entry point (`make run`, or `streamlit run app.py`).
"""
