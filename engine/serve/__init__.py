"""`serveplan engine serve`: the engine behind an OpenAI-compatible HTTP API (docs/serving.md).

By role: protocol.py the request and response bodies; api.py the routes and the mapping between
API requests and engine requests; async_engine.py the engine thread and how requests cross to
it; detokenize.py streamed text; metrics.py the Prometheus metrics; middleware.py the body-size
limit; server.py uvicorn and shutdown.
"""
