"""``python -m tiercache.tools.bench``: the same as ``tiercache bench``."""

from tiercache.tools.bench.cli import main

raise SystemExit(main())
