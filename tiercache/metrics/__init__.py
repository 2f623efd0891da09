"""The Prometheus side: the collector over the region and index, and the HTTP exporter."""
