"""``python -m miles_env``: the miles-env command line."""

import sys

from miles_env.cli import main

sys.exit(main())
