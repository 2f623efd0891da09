"""The coordinator process: serve loop, signal handling, spawning a serve process, and what
``tiercache clean`` removes besides regions (cleanup)."""
