"""Benchmarks behind `ftis-node bench ...`; each returns a JSON-able dict and formats a table."""
