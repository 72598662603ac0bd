"""The local stack and the cluster's applications: launch.py (`osd serve`: Ray, Redis and the
Serve app), up.py (`osd up`: serving, the trainer group and the rollout controller, supervised),
cluster.py (the Serve applications the Helm chart names: `pipeline.stack.cluster:serving_app`
and `:loop_app`) and profiles.py (the closed loop's settings for a demo-sized run)."""
