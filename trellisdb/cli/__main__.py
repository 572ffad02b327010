"""``python -m trellisdb.cli``: the ``trellis`` command."""

import sys

from trellisdb.cli import main

sys.exit(main())
