"""``python -m datastates.client.ctl``: the ``datastatesctl`` command, where its script is not installed."""

import sys

from . import main

sys.exit(main())
