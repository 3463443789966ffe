"""From the sidecar's deltas to OpenAI responses: SSE chunks or one JSON body."""
