"""Several models on one device: one loop, one budget, one shared KV page pool (docs/multi_model.md)."""
