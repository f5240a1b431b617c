"""`hybridrt serve`: an OpenAI-compatible HTTP server over one loaded model.

errors.py   OpenAI-shaped error bodies and their HTTP status
schemas.py  request bodies -> validated `GenRequest`, results -> response / chunk bodies
stops.py    text-level stop strings over a token stream
logprobs.py token log-probabilities (`logprobs`, `top_logprobs`, `echo`) and which tokens a response shows
pool.py     the --parallel sessions, the bounded FIFO queue and the decoding worker threads
metrics.py  counters and the Prometheus text of GET /metrics
app.py      the Starlette routes, SSE streaming and client-disconnect handling
"""
from .app import create_app
from .pool import ServeConfig, SessionPool

__all__ = ["create_app", "ServeConfig", "SessionPool"]
