"""`pd-gateway bench replay`: trace replay against routers on emulated or real clusters.

Modules: `trace` (inputs), `synthetic` (generated workloads), `prompts` (prompts whose shared
blocks are the same tokens), `client` (open- and closed-loop streaming load), `cluster` (the
workers and their counters), `targets` (the front ends under test), `reference` (reachable
reuse, simulated), `stats` (percentiles, SLOs, goodput), `report` (Markdown, JSON, plots) and
`main` (the command line).
"""
