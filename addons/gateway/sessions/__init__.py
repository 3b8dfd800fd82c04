"""Sessions: one rollout's secrets, model, sampling, upstream and limits, the operator's
declared upstreams, and the task state its tool servers write."""
