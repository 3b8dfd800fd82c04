"""Policy: what the evaluator decides about an exchange before it leaves and as its answer
comes back (stops, limits, hooks and the rewrites they leave, network mediation)."""
