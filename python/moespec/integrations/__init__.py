"""Integrations of moespec into serving engines (each imports its engine lazily; the core package
never imports one)."""
