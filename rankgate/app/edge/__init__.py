"""What is read and checked at the edge, before a body is decoded: keys, size and shape limits,
headers, request ids and the affinity key.
"""
