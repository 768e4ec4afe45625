"""``python -m mhe.cli`` is the ``mhe`` command."""

import sys

from mhe.cli import main

sys.exit(main())
