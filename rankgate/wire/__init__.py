"""The wire code the gateway's gRPC client and the mock engine's gRPC server share: the sans-IO
HTTP/2 core, gRPC message framing and the generated stubs of vLLM's contract.

It knows bytes, frames and messages, never routing or HTTP/1.1, and imports nothing else of
Rankgate's, so the mock engine loads it without the sidecar.
"""
