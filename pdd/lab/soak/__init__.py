"""`pdd soak`: thousands of requests through a live deployment while faults hit it.

The deployment is started in-process (`pdd.lab.deploy.Launcher`), so instances can be
killed and restarted on their own ports; the line emulator's admin API stalls,
blackholes, drops and narrows the line. Every request ends as completed, failed with
an error the client was told about, or lost (the client was told nothing: a hang, a
reset, a stream that just stops). A healthy system loses nothing and leaks no pages.
"""
