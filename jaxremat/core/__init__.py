"""The vocabulary every layer shares: chain costs, ops and schedule trees, the simulator,
schedules, budgets and byte units, the loop rules of ``Repeat`` layers, and the compile options
that keep remat real. ``docs/cost_model.md`` is the contract these implement."""
