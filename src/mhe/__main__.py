"""``python -m mhe`` is the ``mhe`` command."""

import sys

from mhe.cli import main

sys.exit(main())
