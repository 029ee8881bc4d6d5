"""Scheduling: the token-budget scheduler, its async variant, chunked prefill and what one step
hands out and gets back."""
