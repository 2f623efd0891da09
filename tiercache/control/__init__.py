"""The control plane: the coordinator's index served over a Unix socket, and the client.

Server side (in ``tiercache serve``): ``server`` (the selector loop), ``turns`` (fair
turns between connections), ``admission`` (who gets a connection), ``connections``,
``sessions`` (who holds what, alive or not), ``upkeep`` (deadlines and expiries),
``verbs`` (each verb against the index), ``sockets`` (trust: SO_PEERCRED, the socket's
directory), ``options``, ``standalone``. Both sides: ``protocol`` (frames) and
``payloads`` (what each verb carries; never pickle). Client side (engines' schedulers):
``client`` (the verbs), ``channel`` (finding and trusting the coordinator, HELLO,
reconnect, heartbeat), ``jobs`` (multi-rank completion).
"""
