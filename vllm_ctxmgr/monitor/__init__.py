"""Watching a service once it serves: verify, the scheduled verification (schedule), the one-screen
status, and the Prometheus textfile (metrics)."""
