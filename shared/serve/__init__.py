"""The HTTP service's shared parts: the OpenAI wire format, HTTP guards,
metrics, and finding a running service (its runtime dir and control socket).

Owns: what the gateway and the service commands share. May import: errors,
wire, text.
"""
