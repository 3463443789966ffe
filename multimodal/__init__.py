"""Images from OpenAI content parts to vLLM ``MediaItem`` inputs with content-hash identities."""
