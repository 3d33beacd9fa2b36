"""Baselines that DynPipe's benchmarks compare against (run inside an initialised process group)."""
