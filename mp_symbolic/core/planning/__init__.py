"""Plan before you run: the memory estimate and the planner."""
