"""A cluster-scale discrete-event simulator of pdd deployments.

It decides with the functions in `pdd.policy` that the router and the instances call,
so what is simulated is what is served; `pdd sim check` measures how far its numbers
are from the live system's on this machine.
"""
