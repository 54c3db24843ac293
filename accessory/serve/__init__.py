"""Serving a model over HTTP: the continuous-batching service (engine.py), the OpenAI-compatible API (api.py), and
the process that runs them under torchrun (server.py)."""
