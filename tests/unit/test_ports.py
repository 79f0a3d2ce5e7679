"""emulator/ports.py: ports picked together are distinct (the probes are held open while picking).

Picked one by one, each probe closed before the next, the kernel may hand the same port back:
a fresh-clone CI run once started an SGLang prefill emulator with its bootstrap and KV ports both
36847, and it exited. 300 picks made that way repeated a port in 20 of 20 trials on the
development machine, so the first test fails on that scheme."""

from __future__ import annotations

import socket

from emulator.ports import free_port, free_ports


def test_ports_picked_together_are_distinct_and_bindable() -> None:
    ports = free_ports(300)
    assert len(set(ports)) == 300
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_one_port() -> None:
    p = free_port()
    assert 0 < p < 65536
