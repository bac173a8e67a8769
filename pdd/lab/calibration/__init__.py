"""The simulator against this machine (`pdd sim calibrate`, `check`, `line`): a step
model measured from the engine, and the simulated deployment, line and workload of a
`pdd demo` run compared with the live one."""
