"""Helix Locks: a lock authority for background workers, in front of PostgreSQL."""
