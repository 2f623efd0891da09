"""The coordinator process: serve loop, signal handling, and spawning a serve process."""
