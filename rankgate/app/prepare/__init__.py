"""From an OpenAI request to a tokenized, validated
:class:`rankgate.sidecar.types.PreparedRequest`."""
