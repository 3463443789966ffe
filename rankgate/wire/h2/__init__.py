"""The sans-IO HTTP/2 core (RFC 9113) that the gateway's gRPC client and the mock engine's
gRPC server both run on: frames, settings, flow control, header blocks, limits and errors.

Nothing here touches a socket, an event loop or gRPC; a role feeds received bytes to
:meth:`~rankgate.wire.h2.connection.H2Connection.receive`, sends through its ``write`` and hears
about streams through a few hooks. The roles are :mod:`rankgate.sidecar.http2` (client) and
:mod:`rankgate.mocker.h2_connection` (server).
"""
