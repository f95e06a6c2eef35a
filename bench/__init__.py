"""``specmesh bench``: the serving benchmark (workloads, runners, probes, report). See README.md."""
