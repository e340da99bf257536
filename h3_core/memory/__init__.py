"""Device memory: predict a run's peak, plan what to give up, apply the plan (offload, streaming)."""
