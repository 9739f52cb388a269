"""Operators' tools: the command line, the cluster report, Prometheus metrics and the HTTP server.

May import: store, config, leader, dynamic, schedules, errors, signals, base. Never beat or worker.
"""
