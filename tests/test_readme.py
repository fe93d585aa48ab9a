"""The README's solver example runs as written."""

import re
from pathlib import Path


def test_readme_solver_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## Using the solver\n\n```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["sched"].peak <= namespace["sched"].budget
    assert namespace["front"]
