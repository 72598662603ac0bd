"""Training: the DeepSpeed distillation trainers that learn drafts from the record stream."""
