"""The README's solver example runs as written."""

import re
from pathlib import Path


def test_readme_solver_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## The solver on its own\n\n```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["sched"].peak <= namespace["sched"].budget
    assert namespace["front"]


def test_readme_training_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## Training under a budget\n\n```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    plan = namespace["loss_fn"].plan(namespace["params"], namespace["x"], namespace["y"])
    assert plan.predicted_peak <= plan.schedule.budget and any(d.recomputed for d in plan.schedule.decisions())


def test_readme_is_short_and_its_commands_are_real():
    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    assert 150 <= len(text.splitlines()) <= 220
    for script in re.findall(r"python (benchmarks/\w+\.py|examples/\w+\.py)", text):
        assert (root / script).exists(), script
    for doc in re.findall(r"`(docs/\w+\.md)`", text):
        assert (root / doc).exists(), doc
