"""Performance models: the chip catalog, a model's shape, the step model and its physics,
and the emulated-chip pacing model. Shared by the serving code (an instance paced as an
emulated chip), the simulator, the planner and the demo."""
