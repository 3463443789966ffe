"""The gateway's configuration: every ``rankgate serve`` flag, declared once, and the typed
settings they build.
"""
