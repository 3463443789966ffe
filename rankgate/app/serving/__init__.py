"""The serving runtime under the API: the HTTP/1.1 protocol, connections and their clients, the
fast path to the hot routes, work offloaded from the event loop, worker processes and shutdown.
"""
