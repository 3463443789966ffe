"""Rankgate's HTTP surface: the OpenAI-compatible API, request preparation and the CLI."""

__version__ = "0.1.0"
