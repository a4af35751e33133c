"""The README's routing example runs and prints what the README says it prints."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_routing_example_is_true():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Routing and the expert budget"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    for name, expected in re.findall(r"print\((\w+)\.stats\)\s+# (RoutingStats\(.*?\))", code):
        assert repr(namespace[name].stats) == expected, name
    assert namespace["capped"].active.numel() == 16
