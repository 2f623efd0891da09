"""The Prometheus side: the collector over the region and index, the text exposition, and
the bounded HTTP exporter."""
