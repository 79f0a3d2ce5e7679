"""Worker discovery: the gateway's worker set kept equal to what an orchestrator reports.

`sync.WorkerSync` turns "this worker should (not) exist" into registry changes, one worker at a
time, through the admin API's own path (probe, add; drain, wait for in-flight requests, remove).
`kubernetes.KubernetesDiscovery` feeds it from the Kubernetes API (list + watch of pods by label
selector, one per role). kubernetes-asyncio is imported only when discovery is configured.
"""
