from __future__ import annotations

import sys

from trellisdb.cli import main

sys.exit(main())
