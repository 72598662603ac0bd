"""The ops page: one screen for which draft serves, whether the canary wins, and whether the
loop is healthy.

- `source`: the summary document, from Redis, the registry and the replicas' counters
  (`OpsSource`), and the ingress's stream poller (`StreamPoller`);
- `stats`: the numbers in it, pure;
- `page` and `svg`: its HTML and charts, server-side;
- `routes`: the `/ops` routes on the ingress;
- `auth`: the page's sign-in (the proxy imports only this, so nothing here imports the rest).
"""
