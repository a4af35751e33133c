import sys

from moespec.default_model.pipeline import main

sys.exit(main())
