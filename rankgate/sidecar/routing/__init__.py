"""Choosing a data-parallel rank for each request: KV-event intake, the prefix index, load
tracking and the policies (``kv``, ``load``, ``round_robin``, ``engine``)."""
