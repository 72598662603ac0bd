"""The HTTP side of serving. `app` builds the Ray Serve application: an ingress and the target
replicas. `openai_protocol` and `params` are the OpenAI request and response shapes, and the
fields this server refuses; `chat_template` renders a conversation; `proxy_auth` checks API keys
at Serve's proxy; `hot_swap` picks each request's draft version and swaps versions under load;
`metrics` tags every serving metric with that version; `ops/` is the operator's page.
May import every other room of serve/; none of them imports this one."""
