"""Programs built on the library: the transfer benchmark, the index benchmark, the demo."""
