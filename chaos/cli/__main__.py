"""`python -m chaos.cli`: the same as the `pdchaos` console script."""

import sys

from chaos.cli import main

sys.exit(main())
