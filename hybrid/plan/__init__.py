"""The layout planner: hardware, the cost model, one layout's predicted step, the search (`hybrid-plan`)."""
