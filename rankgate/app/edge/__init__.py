"""What is read and checked at the edge, before a body is decoded: keys, size and shape limits,
the request's head (its request id, rank pin and session), and the affinity key.
"""
