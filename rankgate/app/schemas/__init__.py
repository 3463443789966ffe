"""OpenAI wire shapes as msgspec Structs: decoded and encoded in C; the source of /openapi.json."""
