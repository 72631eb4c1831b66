"""The OpenAI-compatible HTTP server (``atom serve``): see :mod:`atom.entrypoints.openai.api_server`."""
