"""Imported by the fork server that local CPU ranks are forked from (forkserver.rank_preload lists it first), and by
nothing else: importing it makes the importing process ignore SIGTERM.

A service manager stops a server by SIGTERM to every process of its group (systemd's default KillMode=control-group,
`kill -- -PGID`). The fork server is in that group; dying, it takes with it the pipe through which it reports its
children's exits, so the launcher read every rank as "exited with code 255" while rank 0 was still draining. Ignoring
SIGTERM, it lives until the launcher does (it exits when the launcher's end of its pipe closes, even after SIGKILL).
Its children inherit the disposition: launch._rank_process puts SIGTERM back to the default first thing, and a
command's ranks set their own (dsrun serve's rank 0 drains, its other ranks ignore it and follow rank 0)."""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
