"""``python -m moespec``: the moespec command line (see :mod:`moespec.cli`)."""

import sys

from moespec.cli import main

sys.exit(main())
