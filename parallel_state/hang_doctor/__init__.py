"""The hang doctor: what the ranks were doing when a job hangs or dies, and where they disagree.

Consumers of parallel_state.collectives (above it; nothing below imports this package):
trace.py records each rank's last calls in a memory-mapped ring and dumps it with every
Python stack on a timeout, an error, SIGUSR1 or SIGTERM; trace_report.py reads the ranks'
files and names the first disagreement (tools/hang_report.py prints it); debug_collectives.py
(`--debug-collectives`) has the ranks of a group compare each call before it runs.
"""
