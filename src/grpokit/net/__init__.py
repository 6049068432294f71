"""Networking shared by grpokit's servers: a hardened JSON-over-HTTP server (`server.JsonServer`)."""
