"""`serveplan engine serve`: the engine behind an OpenAI-compatible HTTP API (docs/serving.md).

api.py holds the routes and the request/response mapping, protocol.py the bodies, async_engine.py
the engine thread and how requests cross to it, metrics.py the Prometheus metrics.
"""
