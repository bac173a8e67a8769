"""The lab: everything that is not serving. The cluster simulator and the planner (`sim`),
the benchmarks (`bench`), the soak (`soak`), the line emulator (`line`), the netns lab
(`netns`), the workloads (`workload`), the demo (`demo`, `demo_deploy`) and `pdd up`, a
whole deployment on one machine with its emulator (`deploy`). Behind the `lab` extra: a
server installed without it serves (`tests/test_wall.py`)."""
