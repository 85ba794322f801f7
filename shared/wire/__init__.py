"""The wire between processes: every message type (declared once, validated
at decode) and the ZeroMQ sockets, runtime dir and endpoints they travel on.

Owns: the protocol. May import: errors.
"""
