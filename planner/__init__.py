"""Capacity planning outside the engine: the simulator of every strategy (`planner.simulate`)."""
