"""Sampling: what a request asks of the draw (`params`, no torch: the router and the
HTTP front end read it), the seeded draw on a batch's logits (`draw`, both engines'),
and constrained decoding (`guide`). Import from the modules: this package imports
nothing, so reading a request's parameters never loads torch."""
