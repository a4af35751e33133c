"""``python -m moespec.engine`` = ``moespec build`` (:func:`moespec.engine.build.main`)."""

import sys

from moespec.engine.build import main

sys.exit(main())
