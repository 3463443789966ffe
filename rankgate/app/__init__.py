"""Rankgate's HTTP surface: the OpenAI-compatible API, request preparation and the CLI."""
