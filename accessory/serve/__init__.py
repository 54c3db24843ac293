"""Serving a model over HTTP: the continuous-batching service (service.py), the OpenAI-compatible API (api.py), and
the process that runs them under torchrun (server.py)."""
