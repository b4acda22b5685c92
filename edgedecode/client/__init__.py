"""Clients of the decode daemon."""
