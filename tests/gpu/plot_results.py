"""PNG plots of a GPU check's timings, drawn where matplotlib is (the device machine may lack it):
run on the JSON folder a `tests/gpu/run.sh` call brought back ($OUT):

    .venv/bin/python tests/gpu/plot_results.py <folder with runtime_bench.json / moe_experts_bench.json /
        linear_bench.json / mla.json> [--out docs/images]

writes gpu_steps.png (moespec.bench.plots.gpu_steps_plot), gpu_moe_kernel.png (gpu_moe_plot),
gpu_linear.png (gpu_linear_plot) and gpu_mla.png (mla_plot) for whichever JSON is there. The 2026-12-04 H200 run's JSON is kept in tests/gpu/results/.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from moespec.bench.plots import gpu_linear_plot, gpu_moe_plot, gpu_steps_plot, mla_plot  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "images")
    args = parser.parse_args(argv)
    written = []
    for name, plot, png in (("runtime_bench.json", gpu_steps_plot, "gpu_steps.png"),
                            ("moe_experts_bench.json", gpu_moe_plot, "gpu_moe_kernel.png"),
                            ("linear_bench.json", gpu_linear_plot, "gpu_linear.png"),
                            ("mla.json", mla_plot, "gpu_mla.png")):
        source = args.folder / name
        if source.is_file():
            written.append(plot(json.loads(source.read_text()), args.out / png))
    if not written:
        print(f"no runtime_bench.json, moe_experts_bench.json, linear_bench.json or mla.json in {args.folder}",
              file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
