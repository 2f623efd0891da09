"""The cache index and its control plane: manager, eviction policies, wire protocol, server, client."""
