"""``python -m miles`` (used with ``torchrun --nproc_per_node N -m miles train ...``)."""

import sys

from miles.cli import main

sys.exit(main())
