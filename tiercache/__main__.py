"""``python -m tiercache``: the ``tiercache`` command (the same ``main`` as the installed
script). Importing this module runs nothing."""

import sys

from tiercache.cli import main

if __name__ == "__main__":
    sys.exit(main())
