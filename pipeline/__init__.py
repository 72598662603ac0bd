"""The orchestration on top: the `osd` CLI, the local stack (`osd serve`, `osd up`), the demo,
the rollout controller and its canary rule, load replay and the benchmarks."""
