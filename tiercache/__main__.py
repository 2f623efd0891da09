import sys

from tiercache.cli import main

sys.exit(main())
