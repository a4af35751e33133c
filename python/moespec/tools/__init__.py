"""Developer tools run from the command line (``python -m moespec.tools.<tool>``)."""
