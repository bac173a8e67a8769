"""Every decision the serving system makes, as pure functions over plain data.

The router and the instances call these for live requests; the simulator calls the
same functions for simulated ones, so what is simulated is what is served.

- `routing`: which instance of a role (prefix affinity against load).
- `plan`: a request's instances, and the anomaly filter.
- `pipeline`: P-MD or P-RLD-MD, from the reserved hit and the line's state.
- `handoff`: one-shot or catch-up, chunk size, when to cut over.
- `transfer`: which KV range moves, in which chunks; line estimates.
- `retry`: how long a reservation waits, whether a request is retried.
"""
