"""``python -m teralm.cli ...`` (and ``torchrun ... -m teralm.cli train``) runs ``teralm ...``."""

import sys

from teralm.cli import main

sys.exit(main())
