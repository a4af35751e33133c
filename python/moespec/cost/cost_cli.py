"""``moespec analyze profile | speedup | calibrate``: hardware profiles, predicted speed-up, calibration."""

from __future__ import annotations


def add_parsers(sub) -> None:
    pass


def run(args) -> int:
    raise ValueError(f"unknown command {args.command}")
