"""Transports the collectives layer can run a group's collectives on instead of torch's backend.

shm.py: shared-memory collectives for the CPU ranks of one host (the channel and its protocol,
below parallel_state.collectives, which calls it); shm_setup.py: giving a group a channel
(a collective agreement over gloo, above that layer). This file imports neither, so importing
the channel does not import its set-up.
"""
