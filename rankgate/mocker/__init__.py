"""A mock vLLM engine that speaks vLLM's gRPC contract, for tests, benches and demos."""
