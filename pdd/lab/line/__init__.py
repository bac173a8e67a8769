"""The line emulator (`pdd line`): a userspace TCP relay that behaves like a long line between sites.

A lab tool, not serving transport: nothing in the router or the instances imports it.

Kernel netem is not available where pdd is developed and demonstrated, yet the whole
point of PDD is what a slow, long line does to KV transfer. So the cross-datacenter
bytes of tests and demos go through this relay (or a line shaped in the kernel between
network namespaces, `pdd netns`, with the relay only where delay or faults are
needed), which enforces what a real line would:

* one bandwidth per direction shared by every connection crossing the line (a
  virtual-time token bucket whose burst is a few milliseconds of line time — not
  seconds, which would hide the line's rate — behind a short queue, as in a router);
* a one-way propagation delay plus bounded, seeded jitter that never reorders the
  bytes of a stream (a chunk is delivered no earlier than the one before it);
* faults injected at run time: stall, drop every connection, silent blackhole, and
  line changes — from Python, or over a small HTTP admin API.

"a→b" is client-to-server traffic (towards the route's target), "b→a" the replies.

Modules: `emulated` (settings, shaper, the shared medium), `relay` (routes and the TCP
relay), `admin` (the HTTP control API), `run` (all of it until stopped), `cli`.
"""

from pdd.lab.line.emulated import EmulatedLine, LineSettings
from pdd.lab.line.relay import LineRelay, Route
from pdd.lab.line.run import run_line

__all__ = ["LineSettings", "Route", "EmulatedLine", "LineRelay", "run_line"]
