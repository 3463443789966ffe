"""The in-process bridge between a prepared request and vLLM's gRPC services.

It discovers the engine, watches its health, routes each request to a data-parallel rank and
streams the result back as typed deltas. It never imports ``app``.
"""
