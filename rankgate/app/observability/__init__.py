"""What the gateway tells operators: Prometheus metrics, traces, structured logs, and each
request's record that feeds them.
"""
