"""The orchestration on top of serve/ and train/, in rooms that import only downwards:

    cli/      the `osd` command, one module per command group
    bench/    the benchmarks; each module owns its flags (`add_arguments`) and its `run`
    traffic/  client traffic: `osd replay` and the demo that drives the closed loop with it
    studies/  offline studies of drafts: vocabulary coverage, agreement over budgets
    stack/    the local stack: `osd serve` (launch), `osd up` (the closed loop), the cluster's
              Serve applications (helm), and the demo-sized loop settings
    rollout/  the rollout controller and its canary rule
    teacher/  the warm start's teacher answers through the serving engine, with features

argtypes.py holds the argparse value types that cli/ and bench/ share."""
