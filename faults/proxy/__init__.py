"""The TCP fault proxy: the listener (tcp.py), its faults (spec.py), one relayed connection
(connection.py), its counters (stats.py), a thread to drive it from sync code (thread.py), its HTTP
control API (control.py) and its process (__main__.py)."""
