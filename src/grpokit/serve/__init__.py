"""`grpokit serve-policy`: the policy behind an OpenAI-compatible generation API (serve/policy.py)."""
