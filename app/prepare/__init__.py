"""From an OpenAI request to a tokenized, validated :class:`sidecar.types.PreparedRequest`."""
