"""The control plane's server: the coordinator's index served over a Unix socket (in
``tiercache serve``).

``server`` (the selector loop), ``turns`` (fair turns between connections), ``admission``
(who gets a connection), ``connections``, ``sessions`` (who holds what, alive or not),
``upkeep`` (deadlines and expiries), ``verbs`` (each verb against the index),
``namespaces`` (DESCRIBE: what the event stream learns), ``options``, ``standalone``. The
wire it speaks and the engines' client are ``tiercache.link``, a layer below.
"""
