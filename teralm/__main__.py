"""``python -m teralm ...`` (and ``torchrun ... -m teralm train``) runs ``teralm ...``."""

import sys

from teralm.cli import main

sys.exit(main())
