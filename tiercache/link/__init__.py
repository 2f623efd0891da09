"""The link: an engine's side of the control plane, and the wire both sides speak.

Engines' schedulers (the vLLM scheduler, the SGLang backend, the demo engine) load this
package and nothing of the coordinator wing: ``client`` (the verbs), ``channel`` (finding
and trusting the coordinator, HELLO, reconnect, heartbeat), ``jobs`` (multi-rank
completion over the region's stats blocks). The wire, shared with the control server
(``tiercache.control``), which imports it as a layer below its own: ``protocol`` (frames,
never pickle), ``payloads`` (what each verb carries), ``versions`` (which protocol versions
meet at HELLO), ``sockets`` (trust: SO_PEERCRED, the socket's directory), ``describe``
(DESCRIBE's request and answer) and ``namespaces`` (engine families, namespace
descriptions, key -> engine hash). The values an answer carries are the foundation's
``results``. Plain Python over the standard library and numpy: no pyzmq, no msgspec, no
torch.
"""
