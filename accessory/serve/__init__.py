"""Serving a model over HTTP: the continuous-batching service (service.py); the OpenAI-compatible API (api.py, the
app and its middleware; routes.py, its routes; over schemas.py, validation.py, images.py, limits.py, responses.py,
streaming.py and api_errors.py); and the process that runs them under torchrun (server.py)."""
