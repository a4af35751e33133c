"""One vLLM run for tests/vllm/test_plugin.py, in its own process (vLLM loads plugins once per
process, so a budget needs a fresh one): argv = target folder, head folder, eager|compiled;
MOESPEC_BUDGET from the environment. Prints one JSON line: the outputs and the budget's statistics per routing call."""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its routing is visible here

from test_plugin import generate  # noqa: E402

from moespec.integrations.vllm.budget import STATS  # noqa: E402

folder, head, mode = sys.argv[1], sys.argv[2], sys.argv[3]
outputs = generate(folder, {"method": "eagle3", "model": head, "num_speculative_tokens": 3}, eager=mode == "eager")
print(json.dumps({"outputs": outputs, "stats": [[s.natural_unique, s.kept, s.rerouted, s.dropped] for s in STATS]}))
