"""Worker-side byte moving: KV-cache views, page groups, the planner, handlers and attach."""
