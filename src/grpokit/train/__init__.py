"""Training loops. Until the GRPO trainer lands, it holds the toy demo that exercises the math."""
