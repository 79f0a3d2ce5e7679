"""The command line, above every other package: `pd-gateway serve | emulate | demo | bench`.

The one place that may import both the gateway and the emulator (the demo runs one in front of
the other); nothing imports it (docs/architecture.md, "Layers")."""
